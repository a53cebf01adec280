"""One rank of a device-window test job, on a real GPU (torch) or on the fake CUDA driver.

Run under the embedded launcher::

    python -m flagcx_mesh.launch -n N --timeout T -- python tests/gpu_prog.py SCENARIO --device fake|torch

``--device fake`` needs FLAGCX_MESH_CUDA_DRIVER naming the fake driver (tests/fakecuda.py);
``--device torch`` uses torch's CUDA tensors and streams. FLAGCX_MESH_CUDA_PATH forces a path;
``--expect-alloc`` / ``--expect-user`` name the path expected to every other rank for a
library-allocated (cuMem) window and for a user allocation. Scenarios (each asserts; a failing
rank prints ``FAIL rank R SCENARIO: why`` and exits 1; a passing one ends with ``OK rank R SCENARIO``):

    integrity    random puts (with and without a stream) from a cuMem window into every rank's
                 user window, region per source rank, then random gets back; byte-for-byte
    stream       put_signal on a stream, wait_signal on the target's stream, then a copy on
                 that stream: the copy always sees the data of its signal (never early)
    bad_input    out-of-range ops on device windows and device-to-host-window ops are refused
                 and write nothing; a bad stream is a TypeError
    peer_death   rank 1 dies while rank 0 streams puts to it: flush fails with PeerLost naming it
    compat       compat's one_side_register of device buffers, put_signal / wait_signal on streams
    staged_stream_signal  (FLAGCX_MESH_CUDA_PATH=staged) a put in flight as a tcp frame, then a
                 signal on a stream: the target never sees the signal before the bytes
    held_library_stream  (FLAGCX_MESH_CUDA_PATH=cuda-vmm) a staged put_signal lands while the
                 target's library stream is ordered behind a stream held by a stream wait
    counter      (FLAGCX_MESH_TRANSPORT=tcp) a put_signal over cuda-vmm counts one op
    slow_landing  (staged, slow copies to the device) a staged put the target cannot land in time fails
    get_answer_fails  (staged, cuMemcpyAsync failing) a get the target cannot answer fails naming
                 the driver's result, and the pair stays usable
    bad_cuda_path_env  rank 1 alone has a bad FLAGCX_MESH_CUDA_PATH: registration fails everywhere
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback

from flagcx_mesh import InvalidArgument, Mesh, PeerLost

RANK = -1
SCENARIO = "?"
N = 1 << 20  # bytes per window region set


class Fail(AssertionError):
    pass


def check(cond, msg) -> None:
    if not cond:
        raise Fail(msg() if callable(msg) else msg)


# ---------------------------------------------------------------- devices

class FakeBuf:
    def __init__(self, cu, ptr: int, nbytes: int, owner=None):
        self.cu, self.ptr, self.nbytes, self.owner = cu, ptr, nbytes, owner

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def write(self, off: int, data: bytes) -> None:
        self.cu.write(self.ptr + off, data)

    def read(self, off: int, n: int) -> bytes:
        return self.cu.read(self.ptr + off, n)


class FakeDevice:
    name = "fake"

    def __init__(self):
        import fakecuda

        self.cu = fakecuda.FakeCuda.get()

    def buffer(self, n: int) -> FakeBuf:
        ptr = self.cu.alloc(n)
        buf = FakeBuf(self.cu, ptr, n)
        buf.write(0, bytes(n))
        return buf

    def multimap_buffer(self, n: int) -> FakeBuf:
        """Device memory backed by two cuMem mappings back to back, as an expandable-segments
        tensor is: each mapping must be exported on its own."""
        import ctypes
        import fakecuda

        g = self.cu.granularity()
        half = (n // 2 + g - 1) // g * g
        ptr = fakecuda.CUdeviceptr()
        self.cu.call("cuMemAddressReserve", ctypes.byref(ptr), 2 * half, 0, 0, 0)
        desc = fakecuda.MemAccessDesc(fakecuda.MemLocation(1, 0), 3)
        for i in range(2):
            h = self.cu.mem_create(half)
            self.cu.call("cuMemMap", ptr.value + i * half, half, 0, h, 0)
            self.cu.call("cuMemSetAccess", ptr.value + i * half, half, ctypes.byref(desc), 1)
        buf = FakeBuf(self.cu, ptr.value, n)
        buf.write(0, bytes(n))
        return buf

    def window_bytes(self, win) -> FakeBuf:
        return FakeBuf(self.cu, win._address, win.size, owner=win)

    def stream(self, legacy: bool = False):
        return 0 if legacy else self.cu.stream()

    def sync(self, s) -> None:
        self.cu.synchronize(s)

    def copy_async(self, dst, src, n: int, s) -> None:
        self.cu.memcpy_async(dst.ptr, src.ptr, n, s)


class TorchBuf:
    def __init__(self, t):
        self.t, self.nbytes = t, t.numel()

    @property
    def __cuda_array_interface__(self):
        return self.t.__cuda_array_interface__

    def write(self, off: int, data: bytes) -> None:
        import torch

        self.t[off:off + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        torch.cuda.synchronize()

    def read(self, off: int, n: int) -> bytes:
        import torch

        torch.cuda.synchronize()
        return self.t[off:off + n].cpu().numpy().tobytes()


class TorchDevice:
    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch
        torch.cuda.init()

    def buffer(self, n: int) -> TorchBuf:
        return TorchBuf(self.torch.zeros(n, dtype=self.torch.uint8, device="cuda"))

    def multimap_buffer(self, n: int) -> TorchBuf:
        return self.buffer(n)  # run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

    def window_bytes(self, win) -> TorchBuf:
        return TorchBuf(self.torch.as_tensor(win, device="cuda"))

    def stream(self, legacy: bool = False):
        # torch's current stream is the legacy default stream (handle 0) unless told otherwise
        return self.torch.cuda.default_stream() if legacy else self.torch.cuda.Stream()

    def sync(self, s) -> None:
        s.synchronize()

    def copy_async(self, dst, src, n: int, s) -> None:
        with self.torch.cuda.stream(s):
            dst.t[:n].copy_(src.t[:n], non_blocking=True)


# ---------------------------------------------------------------- helpers

def pattern(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def check_paths(mesh: Mesh, win, expect: str, what: str) -> None:
    for peer, (path, why) in enumerate(win.paths):
        want = "cuda-self" if peer == mesh.rank else expect
        check(path == want, lambda: f"{what} window: peer {peer} path {path} ({why}), expected {want}")


def ops_for(src: int, dst: int, region: int, count: int, big: bool = False):
    """The random (off, size, use_stream) puts rank src makes into its region at dst (big:
    mostly several MiB, so puts cross the mappings of an expandable-segments tensor)."""
    rng = random.Random(src * 1000 + dst)
    out = []
    for _ in range(count):
        size = rng.choice([1, 7, 64, 4096, 65536, rng.randrange(1, region)])
        if big:
            size = rng.randrange(region // 4, region // 2)
        off = rng.randrange(0, region - size + 1)
        out.append((off, size, rng.random() < 0.5))
    return out


# ---------------------------------------------------------------- scenarios

def scenario_integrity(mesh: Mesh, dev, args) -> None:
    n, r = mesh.nranks, mesh.rank
    region = N // n
    src = mesh.alloc_window(N, device=0)  # cuMem
    size = N + 4096 * r  # sizes differ per rank
    user = dev.multimap_buffer(size) if args.user == "multimap" else dev.buffer(size)
    dst = mesh.register_window(user)
    if args.expect_alloc:
        check_paths(mesh, src, args.expect_alloc, "alloc")
    if args.expect_user:
        check_paths(mesh, dst, args.expect_user, "user")
    dev.window_bytes(src).write(0, pattern(r, N))
    mesh.barrier(timeout=60)
    stream = dev.stream()
    for peer in range(n):
        for off, size, on_stream in ops_for(r, peer, region, args.ops, big=args.size > (8 << 20)):
            mesh.put(peer, src, off, dst, r * region + off, size, stream=stream if on_stream else None)
    mesh.flush(timeout=60)
    mesh.barrier(timeout=60)
    got = user.read(0, n * region)
    for s in range(n):  # replay what rank s wrote into its region here
        model = bytearray(region)
        ps = pattern(s, N)
        for off, size, _ in ops_for(s, r, region, args.ops, big=args.size > (8 << 20)):
            model[off:off + size] = ps[off:off + size]
        seen = got[s * region:(s + 1) * region]
        if seen != bytes(model):
            bad = next(i for i in range(region) if seen[i] != model[i])
            raise Fail(f"region of rank {s}: first wrong byte at {bad} (got {seen[bad]}, want {model[bad]})")
    # gets: every peer's cuMem window back into this rank's user window
    mesh.barrier(timeout=60)
    rng = random.Random(99 + r)
    for peer in range(n):
        size = rng.randrange(1, region)
        off = rng.randrange(0, N - size)
        mesh.get(peer, src, off, dst, 0, size, stream=stream if peer % 2 else None)
        mesh.flush(timeout=60)
        dev.sync(stream)
        check(user.read(0, size) == pattern(peer, N)[off:off + size], f"get of {size} bytes from peer {peer}")
    mesh.barrier(timeout=60)
    print(f"modes alloc={src.mode} user={dst.mode}", flush=True)


def scenario_stream(mesh: Mesh, dev, args) -> None:
    """Rank 0 streams put_signal to rank 1 (region k, then +1 on slot 0); rank 1's stream waits
    for slot >= k and copies region k: the copy must see iteration k's bytes."""
    rounds, chunk = args.rounds, 64 << 10
    sig = mesh.signal_window(4)
    src = mesh.alloc_window(chunk * rounds, device=0)
    dst = mesh.alloc_window(chunk * rounds, device=0)
    stream = dev.stream(legacy=args.legacy_stream)
    if mesh.rank == 0:
        srcb = dev.window_bytes(src)
        for k in range(rounds):
            srcb.write(k * chunk, bytes([k % 251 + 1]) * chunk)
        for k in range(rounds):
            mesh.put_signal(1, src, k * chunk, dst, k * chunk, chunk, 0, 1, signal_window=sig, stream=stream)
        mesh.flush(timeout=60)
    elif mesh.rank == 1:
        dstb = dev.window_bytes(dst)
        check_buf = dev.buffer(chunk * rounds)
        for k in range(rounds):
            mesh.wait_signal(0, k + 1, timeout=60, window=sig, stream=stream)
            dev.copy_async(_slice(dev, check_buf, k * chunk), _slice(dev, dstb, k * chunk), chunk, stream)
        dev.sync(stream)
        got = check_buf.read(0, chunk * rounds)
        for k in range(rounds):
            part = got[k * chunk:(k + 1) * chunk]
            check(part == bytes([k % 251 + 1]) * chunk,
                  lambda: f"round {k}: the stream passed its wait before the data landed "
                          f"({sum(1 for b in part if b != k % 251 + 1)} wrong bytes)")
        check(mesh.read_signal(0, window=sig) == rounds, "final signal value")
    mesh.barrier(timeout=60)


def _slice(dev, buf, off: int):
    if dev.name == "fake":
        return FakeBuf(buf.cu, buf.ptr + off, buf.nbytes - off)
    return TorchBuf(buf.t[off:])


def scenario_bad_input(mesh: Mesh, dev, args) -> None:
    n, r = mesh.nranks, mesh.rank
    dwin = mesh.alloc_window(4096, device=0)
    hwin = mesh.alloc_window(4096)
    peer = (r + 1) % n
    dev.window_bytes(dwin).write(0, bytes([7]) * 4096)
    mesh.barrier(timeout=60)
    refused = [
        ("remote range", lambda: mesh.put(peer, dwin, 0, dwin, 4000, 200)),
        ("local range", lambda: mesh.put(peer, dwin, 4000, dwin, 0, 200)),
        ("peer out of range", lambda: mesh.put(n, dwin, 0, dwin, 0, 8)),
        ("device memory and the peer's window is host memory", lambda: mesh.put(peer, dwin, 0, hwin, 0, 8)),
        ("remote range", lambda: mesh.get(peer, dwin, 4090, dwin, 0, 100)),
    ]
    for text, op in refused:
        try:
            op()
        except InvalidArgument as e:
            check(text in str(e), f"refusal should name '{text}': {e}")
        else:
            raise Fail(f"not refused: {text}")
    try:
        mesh.put(peer, dwin, 0, dwin, 0, 8, stream="not a stream")
    except TypeError:
        pass
    else:
        raise Fail("a bad stream was accepted")
    mesh.flush(timeout=60)
    mesh.barrier(timeout=60)
    check(dev.window_bytes(dwin).read(0, 4096) == bytes([7]) * 4096, "a refused op wrote into a device window")
    check(bytes(hwin.buffer) == bytes(4096), "a refused op wrote into a host window")


def scenario_peer_death(mesh: Mesh, dev, args) -> None:
    win = mesh.alloc_window(1 << 20, device=0)
    mesh.barrier(timeout=60)
    if mesh.rank == 1:
        time.sleep(0.3)
        print(f"OK rank 1 {SCENARIO} (dying)", flush=True)
        os._exit(0)
    if mesh.rank != 0:
        return
    stream = dev.stream()
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 30:
            mesh.put(1, win, 0, win, 0, 1 << 20, stream=stream)
            mesh.flush(timeout=30)
    except PeerLost as e:
        check(e.peer == 1 or "peer 1" in str(e), f"PeerLost should name peer 1: {e}")
        print(f"peer loss seen after {time.monotonic() - t0:.1f} s: {e}", flush=True)
        return
    raise Fail("no PeerLost within 30 s of rank 1's death")


def scenario_compat(mesh: Mesh, dev, args) -> None:
    """FlagCX's shape: device tensors registered, put_signal and wait_signal on streams."""
    from flagcx_mesh import compat as fc

    comm = fc.Comm(mesh, timeout=60)
    n, r = mesh.nranks, mesh.rank
    src, dst = dev.buffer(1 << 20), dev.buffer(n << 20)
    s_idx, d_idx = comm.one_side_register(src), comm.one_side_register(dst)
    comm.signal_register(8 * n)
    src.write(0, pattern(100 + r, 1 << 20))
    mesh.barrier(timeout=60)
    stream = dev.stream()
    for peer in range(n):
        comm.put_signal(peer, 0, r << 20, 1 << 20, 8 * r, s_idx, d_idx, 1, stream)
    for peer in range(n):
        comm.wait_signal(peer, 8 * peer, 1, stream)
    dev.sync(stream)
    for peer in range(n):
        check(dst.read(peer << 20, 1 << 20) == pattern(100 + peer, 1 << 20), f"compat: bytes from rank {peer}")
    comm.flush(timeout=60)
    mesh.barrier(timeout=60)


def scenario_staged_stream_signal(mesh: Mesh, dev, args) -> None:
    """Run with FLAGCX_MESH_CUDA_PATH=staged. Rank 0 puts region k (staged: a tcp frame in
    flight), then signals slot 0 on a stream (the signal window is shm, mapped here); rank 1
    waits for slot 0 >= k + 1 and reads region k: FIFO per pair says its bytes are there."""
    rounds, chunk = args.rounds, 4 << 20
    sig = mesh.signal_window(4)
    win = mesh.alloc_window(chunk * rounds, device=0)
    check_paths(mesh, win, "staged", "device")
    stream = dev.stream()
    if mesh.rank == 0:
        b = dev.window_bytes(win)
        for k in range(rounds):
            b.write(k * chunk, bytes([k % 251 + 1]) * chunk)
    mesh.barrier(timeout=60)
    early = []
    if mesh.rank == 0:
        for k in range(rounds):
            mesh.put(1, win, k * chunk, win, k * chunk, chunk)
            mesh.signal(1, 0, 1, signal_window=sig, stream=stream)
        mesh.flush(timeout=60)
    elif mesh.rank == 1:
        b = dev.window_bytes(win)
        for k in range(rounds):
            mesh.wait_signal(0, k + 1, timeout=60, window=sig)
            if b.read(k * chunk, chunk) != bytes([k % 251 + 1]) * chunk:
                early.append(k)
    mesh.barrier(timeout=60)
    check(not early, lambda: f"rounds {early}: the signal queued on a stream was applied before the "
                             f"earlier staged put's bytes landed")


def scenario_bad_cuda_path_env(mesh: Mesh, dev, args) -> None:
    """Only rank 1 has a bad FLAGCX_MESH_CUDA_PATH: a registration must fail on every rank
    (naming rank 1), never succeed on some ranks and fail on others."""
    if mesh.rank == 1:
        os.environ["FLAGCX_MESH_CUDA_PATH"] = "bogus"
    outcome = "registered"
    try:
        mesh.alloc_window(4096)
    except InvalidArgument as e:
        outcome = f"refused: {e}"
    if mesh.rank == 1:
        del os.environ["FLAGCX_MESH_CUDA_PATH"]
    print(f"rank {mesh.rank} {outcome}", flush=True)
    check(outcome != "registered", "the registration succeeded here although rank 1 could not take part")
    mesh.barrier(timeout=60)


def scenario_held_library_stream(mesh: Mesh, dev, args) -> None:
    """Run with FLAGCX_MESH_CUDA_PATH=cuda-vmm (cuMem windows cuda-vmm, cudaMalloc ones staged).
    Rank 0 holds stream a with a stream wait on slot 3, queues a put on a, then a put without a
    stream (the library's stream, ordered after a). Rank 1's staged put_signal to rank 0 sets
    slot 3: rank 0's progress thread must land it (and so release a), whatever waits on a."""
    sig = mesh.signal_window(4)
    v = mesh.alloc_window(1 << 16, device=0)
    ubuf = dev.buffer(1 << 16)
    u = mesh.register_window(ubuf)
    check_paths(mesh, v, "cuda-vmm", "alloc")
    check_paths(mesh, u, "staged", "user")
    mesh.barrier(timeout=60)
    if mesh.rank == 0:
        a = dev.stream()
        mesh.wait_signal(3, 1, window=sig, stream=a)  # a is held until rank 1's put_signal lands
        mesh.put(1, v, 0, v, 0, 4096, stream=a)
        mesh.put(1, v, 4096, v, 4096, 4096)  # no stream: FIFO puts it after a's put
    mesh.barrier(timeout=60)
    if mesh.rank == 1:
        mesh.put_signal(0, u, 0, u, 0, 4096, 3, 1, signal_window=sig)
    elif mesh.rank == 0:
        mesh.wait_signal(3, 1, timeout=20, window=sig)
    mesh.flush(timeout=20)
    mesh.barrier(timeout=60)


def scenario_counter(mesh: Mesh, dev, args) -> None:
    """Run with FLAGCX_MESH_TRANSPORT=tcp (device windows cuda-vmm, the signal window tcp):
    each put_signal is one op for read_counter / wait_counter, as on every host path."""
    sig = mesh.signal_window(4)
    v = mesh.alloc_window(1 << 16, device=0)
    check_paths(mesh, v, "cuda-vmm", "device")
    mesh.barrier(timeout=60)
    counted = 4
    if mesh.rank == 0:
        before = mesh.read_counter()
        for _ in range(4):
            mesh.put_signal(1, v, 0, v, 0, 4096, 0, 1, signal_window=sig)
        mesh.flush(timeout=60)
        counted = mesh.read_counter() - before
    mesh.barrier(timeout=60)
    check(counted == 4, f"4 put_signals counted as {counted} completed ops")


def one_op_fails_then_rank_1_still_serves(mesh: Mesh, hwin, what: str, op, flush_timeout: float) -> str:
    """Rank 0 runs `op` and flushes, expecting a failure; then rank 1 puts to rank 0 over host
    windows (no CUDA copy involved). Rank 0 gets its op's outcome, rank 1 "ok" or what failed."""
    outcome = "ok"
    if mesh.rank == 0:
        try:
            op()
            mesh.flush(timeout=flush_timeout)
            outcome = f"the {what} succeeded"
        except Exception as e:  # noqa: BLE001
            outcome = f"{type(e).__name__}: {e}"
        print(f"rank 0 {what}: {outcome}", flush=True)
    mesh.barrier(timeout=60)
    if mesh.rank == 1:
        try:
            mesh.put(0, hwin, 0, hwin, 0, 8)
            mesh.flush(timeout=15)
        except Exception as e:  # noqa: BLE001
            outcome = f"rank 1 can no longer reach rank 0: {type(e).__name__}: {e}"
    mesh.barrier(timeout=60)
    return outcome


def scenario_get_answer_fails(mesh: Mesh, dev, args) -> None:
    """Run with FLAGCX_MESH_CUDA_PATH=staged and cuMemcpyAsync failing: rank 1 cannot copy its
    device window down to answer rank 0's get. Rank 0's get must fail naming the driver's
    result, and rank 1 must still reach rank 0 afterwards."""
    dwin = mesh.alloc_window(4096, device=0)
    hwin = mesh.alloc_window(4096)
    check_paths(mesh, dwin, "staged", "device")
    mesh.barrier(timeout=60)
    outcome = one_op_fails_then_rank_1_still_serves(mesh, hwin, "get", lambda: mesh.get(1, dwin, 0, hwin, 0, 64), 15)
    if mesh.rank == 0:
        check("CUDA_ERROR_ILLEGAL_ADDRESS" in outcome, f"the get's error should name the driver's result: {outcome}")
    else:
        check(outcome == "ok", outcome)


def scenario_slow_landing(mesh: Mesh, dev, args) -> None:
    """Run with FLAGCX_MESH_CUDA_PATH=staged, a mesh timeout of a few seconds and copies into
    device memory slower than it: rank 1 cannot land rank 0's staged put in time. Rank 0's
    flush must fail naming the landing and the deadline (not succeed once the copy is done),
    and rank 1's engine must still serve rank 0 afterwards."""
    dwin = mesh.alloc_window(4096, device=0)
    hwin = mesh.alloc_window(4096)
    check_paths(mesh, dwin, "staged", "device")
    mesh.barrier(timeout=60)
    outcome = one_op_fails_then_rank_1_still_serves(mesh, hwin, "put", lambda: mesh.put(1, hwin, 0, dwin, 0, 64), 60)
    if mesh.rank == 0:
        check("landing a staged put" in outcome and "deadline" in outcome,
              f"the put's error should name the landing and its deadline: {outcome}")
    else:
        check(outcome == "ok", outcome)


SCENARIOS = {"compat": scenario_compat, "integrity": scenario_integrity, "stream": scenario_stream, "bad_input": scenario_bad_input,
             "peer_death": scenario_peer_death, "staged_stream_signal": scenario_staged_stream_signal,
             "bad_cuda_path_env": scenario_bad_cuda_path_env, "held_library_stream": scenario_held_library_stream,
             "counter": scenario_counter, "get_answer_fails": scenario_get_answer_fails,
             "slow_landing": scenario_slow_landing}


def main() -> int:
    global RANK, SCENARIO
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--device", choices=("fake", "torch"), default="fake")
    ap.add_argument("--expect-alloc", default="")
    ap.add_argument("--expect-user", default="")
    ap.add_argument("--ops", type=int, default=40)
    ap.add_argument("--size", type=int, default=N, help="integrity: bytes of the windows (default 1 MiB)")
    ap.add_argument("--user", choices=("default", "multimap"), default="default",
                    help="the user window: one allocation, or two cuMem mappings (expandable segments)")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--legacy-stream", action="store_true", help="stream: use the legacy default stream (0)")
    ap.add_argument("--mesh-timeout", type=float, default=60, help="the mesh's timeout in seconds")
    args = ap.parse_args()
    SCENARIO = args.scenario
    globals()["N"] = args.size
    dev = FakeDevice() if args.device == "fake" else TorchDevice()
    with Mesh.from_launcher(timeout=args.mesh_timeout) as mesh:
        RANK = mesh.rank
        try:
            SCENARIOS[args.scenario](mesh, dev, args)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL rank {RANK} {SCENARIO}: {e}", flush=True)
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)
        if not (SCENARIO == "peer_death" and RANK == 1):
            print(f"OK rank {RANK} {SCENARIO}", flush=True)
        if SCENARIO == "peer_death":
            os._exit(0)  # the mesh's goodbye to a dead peer is not part of the test
    return 0


if __name__ == "__main__":
    sys.exit(main())
