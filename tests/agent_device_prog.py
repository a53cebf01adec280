"""Agent device-memory scenarios for tests/test_agent_device_fake.py (the fake CUDA driver) and
scripts/test-gpu.sh (--device torch: CUDA tensors on a real GPU), one process per role.

    serve DIR NAME       registers device regions ("ipc": a cudaMalloc buffer, "vmm": a cuMem
                         buffer with a POSIX fd handle, fake driver only) and a host region
                         ("host"), writes DIR/NAME.meta and DIR/NAME.<region>, then answers
                         notifications until "bye": "check R OFF LEN SEED" (the bytes of region
                         R are pattern(SEED), SEED -1: zeros; answers "ok" or "bad ..."),
                         "dereg R" (deregisters it; answers "ok"), "ping" ("ok"), "stats"
                         ("ok waiter_reads=N"); prints "served N". --waits: after the first
                         notification it waits in wait_notification for that peer's next one
    waits DIR NAME       (serve --waits) notifications answered one by one are read by the
                         target's waiting thread itself although device regions are registered
                         there; writes into its device region, each with its notification, land
                         before it (over staged the waiter leaves each write to the progress thread)
    client DIR NAME      every (local, remote) pair with device memory on one side at least:
                         writes, has the target check the bytes, reads them back and checks
                         them; --expect L:R=PATH,... names the path each pair must take
    bad DIR NAME         bad input (ranges, another agent's descriptor, garbage, a deregistered
                         region) is refused and nothing is written
    stream DIR NAME      writes and reads from device memory ordered on a busy stream
    pending DIR NAME     (stdin-driven) issues device writes, then expects PeerLost once the
                         test killed the target
    self                 two agents in this process: every pair takes cuda-self
    dereg-owner DIR NAME a device region deregistered and freed while a staged read's answer is
    dereg-reader DIR NAME  copied down from it (slowed): the reader still gets the right bytes
    blocks DIR NAME      batches of staged writes and reads (write_blocks, read_blocks, one frame a
                         batch): 1 to 100,000 blocks, mixed sizes, blocks straddling chunks, every
                         byte checked; bad blocks refused with nothing written (serve answers
                         "sha R OFF LEN HEX")
    blocks-lost DIR NAME (stdin-driven) a 64 MiB batch to (--expect read: from) a target stopped,
                         then killed: PeerLost
    blocks-forged DIR NAME  a forged batch frame with a block past the region's end: refused by
                         the target whole, nothing landed
    pair                 runs each of --roles against its own serve process (scripts/test-gpu.sh)
Each role prints "<role> ok" when it passed; any failure exits non-zero.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

import flagcx_mesh
from flagcx_mesh.agent import Agent
from gpu_prog import FakeBuf, TorchBuf  # device buffers shared with the Mesh device tests
from meshutil import acked_since, bytes_acked, lane_sockets, publish, read_published

SECRET = "agent-device-test-secret"
SIZE = 1 << 20
FILE_TIMEOUT = 60.0  # seconds a role waits for a file another one publishes
DEVICE_REGIONS = ("ipc", "vmm")


def pattern(seed: int, n: int) -> bytes:
    if seed < 0:
        return bytes(n)
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed) % 251).astype(np.uint8).tobytes()


def check(cond, msg) -> None:
    if not cond:
        raise SystemExit(f"FAILED: {msg}")


# ---------------------------------------------------------------- devices

class FakeDevice:
    """Device buffers of the fake driver: cuMemAlloc (legacy IPC) and cuMem (POSIX fd)."""

    def __init__(self):
        import fakecuda

        self.cu = fakecuda.FakeCuda.get()
        self.kinds = DEVICE_REGIONS

    def buffer(self, kind: str, n: int) -> FakeBuf:
        if kind == "vmm":
            g = self.cu.granularity()
            size = (n + g - 1) // g * g
            buf = FakeBuf(self.cu, self.cu.map(self.cu.mem_create(size), size), n)
        else:
            buf = FakeBuf(self.cu, self.cu.alloc(n), n)
        buf.write(0, bytes(n))
        return buf

    def exports(self) -> int:
        """cuMem fds this process exported so far."""
        return self.cu.calls("cuMemExportToShareableHandle")

    def calls(self, name: str):
        return self.cu.calls(name)

    def thread_calls(self, name: str):
        """Calls of `name` made by the calling thread."""
        return self.cu.thread_calls(name)

    def stream(self):
        return self.cu.stream()

    def delay(self, s, seconds: float) -> None:
        """The stream does nothing else for `seconds` (a host function that sleeps)."""
        self.cu.launch_host_func(s, lambda: time.sleep(seconds))

    def copy_async(self, dst, dst_off: int, src, src_off: int, n: int, s) -> None:
        self.cu.memcpy_async(dst.ptr + dst_off, src.ptr + src_off, n, s)

    def sync(self, s) -> None:
        self.cu.synchronize(s)


class TorchDevice:
    """CUDA tensors (the caching allocator: cudaMalloc, or cuMem with expandable segments)."""

    def __init__(self):
        import torch

        check(torch.cuda.is_available(), "torch sees no CUDA device")
        self.kinds = ("ipc",)

    def buffer(self, kind: str, n: int) -> TorchBuf:
        import torch

        return TorchBuf(torch.zeros(n, dtype=torch.uint8, device="cuda"))

    def exports(self):
        return None  # the real driver counts nothing for us

    def calls(self, name: str):
        return None

    def thread_calls(self, name: str):
        return None

    def stream(self):
        import torch

        return torch.cuda.Stream()

    def delay(self, s, seconds: float) -> None:
        import torch

        with torch.cuda.stream(s):
            torch.cuda._sleep(int(seconds * 2e9))  # GPU cycles: about `seconds` or more

    def copy_async(self, dst, dst_off: int, src, src_off: int, n: int, s) -> None:
        import torch

        with torch.cuda.stream(s):
            dst.t[dst_off:dst_off + n].copy_(src.t[src_off:src_off + n], non_blocking=True)

    def sync(self, s) -> None:
        s.synchronize()


def make_device(name: str):
    return FakeDevice() if name == "fake" else TorchDevice()


class HostBuf:
    def __init__(self, n: int):
        self.a = np.zeros(n, dtype=np.uint8)

    def write(self, off: int, data: bytes) -> None:
        self.a[off:off + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def read(self, off: int, n: int) -> bytes:
        return self.a[off:off + n].tobytes()


def register(agent: Agent, buf):
    if isinstance(buf, HostBuf):
        return agent.register(buf.a)
    return agent.register(buf.t if isinstance(buf, TorchBuf) else buf)


# ---------------------------------------------------------------- roles

def serve(args, dev) -> None:
    with Agent(args.name, SECRET, timeout=args.timeout) as a:
        bufs = {k: dev.buffer(k, SIZE) for k in dev.kinds}
        bufs["host"] = HostBuf(SIZE)
        regions = {}
        for k, b in bufs.items():
            t0 = time.perf_counter()
            regions[k] = register(a, b)
            took = time.perf_counter() - t0
            print(f"registered {k} ({regions[k].kind}, {SIZE} bytes) in {took * 1e6:.0f} us", flush=True)
            publish(args.dir, f"{args.name}.{k}", regions[k].descriptor)
        print(f"exports after registration: {dev.exports()}", flush=True)
        landings = {c: dev.thread_calls(c) for c in LANDING_CALLS}  # this thread's device work so far
        publish(args.dir, f"{args.name}.meta", a.metadata())
        served, end, waiting_on = 0, time.monotonic() + args.timeout * 4, None
        while time.monotonic() < end:
            for n in next_notifications(a, waiting_on):
                waiting_on = n.peer if args.waits else None
                words = n.data.decode().split()
                if words[0] == "bye":
                    print(f"exports at the end: {dev.exports()}", flush=True)
                    print(f"served {served}", flush=True)
                    print("serve ok", flush=True)
                    return
                if words[0] == "check":
                    r, off, ln, seed = words[1], int(words[2]), int(words[3]), int(words[4])
                    got = bufs[r].read(off, ln)
                    want = pattern(seed, ln)
                    bad = [i for i in range(ln) if got[i] != want[i]][:3] if got != want else []
                    answer = "ok" if not bad else f"bad {r} at {[off + i for i in bad]}"
                elif words[0] == "sha":  # sha R OFF LEN HEX: the bytes' SHA-256 is HEX
                    r, off, ln = words[1], int(words[2]), int(words[3])
                    got = hashlib.sha256(bufs[r].read(off, ln)).hexdigest()
                    answer = "ok" if got == words[4] else f"bad {r}: sha256 {got}"
                elif words[0] == "calls":  # the driver calls this process made (fake driver only)
                    answer = "ok " + " ".join(f"{c}={dev.calls(c)}" for c in ("cuLaunchKernel", "cuMemcpyAsync") + POOLED)
                elif words[0] == "dereg":
                    a.deregister(regions[words[1]])
                    answer = "ok"
                elif words[0] == "ping":
                    answer = "ok"
                elif words[0] == "stats":  # and the device calls this thread made since it registered
                    st, mine = a.stats(), {c: dev.thread_calls(c) for c in LANDING_CALLS}
                    made = None if None in mine.values() else sum(mine[c] - landings[c] for c in LANDING_CALLS)
                    answer = f"ok waiter_reads={st['waiter_reads']} late_wakes={st['progress_late_wakes']} device_calls={made}"
                else:
                    answer = f"bad request {words[0]}"
                served += 1
                end = time.monotonic() + args.timeout * 4  # (a slow client that still asks is not gone)
                try:
                    a.connection(n.peer).notify(answer.encode())
                except (flagcx_mesh.PeerLost, AttributeError):
                    pass  # that peer left
        raise SystemExit("FAILED: serve: no bye within its time")


# The driver calls that landing staged bytes (or answering a read from device memory) makes: a
# thread waiting for notifications must leave them to the progress thread.
LANDING_CALLS = ("cuMemcpyAsync", "cuLaunchKernel", "cuEventRecord", "cuEventQuery")


def next_notifications(a: Agent, peer) -> list:
    """The next notifications: any peer's (notifications(), reading for its first 50 us), or
    `peer`'s next one (wait_notification, reading for its first millisecond)."""
    if peer is None:
        return a.notifications(timeout=0.5)
    try:
        return [a.wait_notification(peer, timeout=0.5)]
    except flagcx_mesh.MeshTimeout:
        return []


def answer(a: Agent, timeout: float) -> str:
    got = a.notifications(timeout=timeout)
    check(len(got) == 1, f"one answer expected, got {got}")
    return got[0].data.decode()


def ask(a: Agent, conn, text: str, timeout: float) -> None:
    conn.notify(text.encode())
    reply = answer(a, timeout)
    check(reply == "ok", f"{text}: {reply}")


def connect(args, a: Agent):
    conn = a.connect(read_published(args.dir, f"{args.name}.meta", FILE_TIMEOUT), timeout=args.timeout)
    # the regions were published before the metadata: the device's kinds are those there
    kinds = [k for k in ("ipc", "vmm", "host") if os.path.exists(os.path.join(args.dir, f"{args.name}.{k}"))]
    return conn, {k: read_published(args.dir, f"{args.name}.{k}", FILE_TIMEOUT) for k in kinds}


def round_trip(a: Agent, conn, local, lbuf, rname: str, remote, seed: int, timeout: float) -> None:
    """Writes pattern(seed) from lbuf at one offset to remote at another, has the target check
    it, reads it back into lbuf elsewhere and checks it (the read's destination zeroed first)."""
    n, loff, roff, back = 300_007, 1_000, 4_321, 500_000
    lbuf.write(loff, pattern(seed, n))
    conn.write(local, remote, n, local_offset=loff, remote_offset=roff,
               notification=f"check {rname} {roff} {n} {seed}".encode()).wait(timeout)
    reply = answer(a, timeout)
    check(reply == "ok", f"write to {rname}: {reply}")
    lbuf.write(back, bytes(n))
    conn.read(local, remote, n, local_offset=back, remote_offset=roff).wait(timeout)
    check(lbuf.read(back, n) == pattern(seed, n), f"read back from {rname}: wrong bytes")


def target_stats(a: Agent, conn, timeout: float) -> dict:
    """serve's "stats": waiter_reads, late_wakes, device_calls (None on a real GPU)."""
    return target_counts(a, conn, "stats", timeout)


def waits_role(args, dev) -> None:
    """Against serve --waits, the target waiting in wait_notification with device regions
    registered. Pings answered one by one (100 at a time, up to 2000): its waiting thread read
    some itself (agent.stats()["waiter_reads"]; until 2026-12-07 it did not read with device
    regions registered: each notification over a GPU path cost the progress thread's wake-up). Then,
    each right after a ping (the target's waiter reading), small reads from its device region
    (over staged gets, which the waiter leaves at their op header to the progress thread) and
    writes of 1 KB, 64 KB and 900 KB carrying their notifications, the bytes checked when each
    arrives (the waiter stops in the payload of a write the progress thread began). At the end:
    no lost wake-up of the target's progress thread (a frame left to it that waited for its
    poll's timer: 100 ms a read), and on the fake driver no device call made by the target's
    waiting thread itself."""
    with Agent(args.name + "-waits", SECRET, timeout=args.timeout) as a:
        conn, remotes = connect(args, a)
        lbuf = dev.buffer("ipc", SIZE)
        local = register(a, lbuf)
        pings, reads = 0, 0
        while reads == 0 and pings < 2000:  # (on a loaded machine a round trip may outlast the target's 1 ms)
            for _ in range(100):
                ask(a, conn, "ping", args.timeout)
            pings += 100
            reads = target_stats(a, conn, args.timeout)["waiter_reads"]
        check(reads > 0, f"the target's wait_notification read none of {pings} notifications itself")
        path = conn.path_to(remotes["ipc"], local)
        for kind, n in (("read", 1_000), ("write", 1_000), ("write", 65_543), ("write", 900_007)):
            for seed in range(2, 62):
                time.sleep(0.003)  # the target's waiter went to sleep: a ping wakes it, then it reads for 1 ms
                ask(a, conn, "ping", args.timeout)
                off = seed * 1_000
                if kind == "read":
                    conn.read(local, remotes["ipc"], n, local_offset=950_000, remote_offset=off).wait(args.timeout)
                    continue
                lbuf.write(0, pattern(seed, n))
                conn.write(local, remotes["ipc"], n, remote_offset=off,
                           notification=f"check ipc {off} {n} {seed}".encode()).wait(args.timeout)
                reply = answer(a, args.timeout)
                check(reply == "ok", f"write {seed} of {n} bytes over {path}: {reply}")
        st = target_stats(a, conn, args.timeout)
        check(st["late_wakes"] == 0, f"the target's progress thread missed {st['late_wakes']} wake-up(s)")
        check(st["device_calls"] in (0, None), f"the target's waiting thread made {st['device_calls']} "
              f"device call(s) itself ({', '.join(LANDING_CALLS)})")
        print(f"waits: the target's waiter read {st['waiter_reads']} times, made {st['device_calls']} device calls; "
              f"60 reads and 180 writes over {path} checked", flush=True)
        conn.notify(b"bye")
    print("waits ok", flush=True)


def parse_expect(text: str) -> dict:
    return dict(item.split("=", 1) for item in text.split(",") if item)


def client(args, dev) -> None:
    expect = parse_expect(args.expect)
    with Agent(args.name + "-client", SECRET, timeout=args.timeout) as a:
        conn, remotes = connect(args, a)
        local_bufs = {"host": HostBuf(SIZE), "dev": dev.buffer("ipc", SIZE)}
        locals_ = {k: register(a, b) for k, b in local_bufs.items()}
        seed, paths = 1, []
        for lk, local in locals_.items():
            for rk, remote in remotes.items():
                if lk == "host" and rk == "host":
                    continue  # host memory on both sides: tests/test_agent.py
                path = conn.path_to(remote, local)
                paths.append(f"{lk}:{rk}={path}")
                want = expect.get(f"{lk}:{rk}")
                check(want is None or path == want, f"{lk} -> {rk}: path {path}, expected {want}")
                round_trip(a, conn, local, local_bufs[lk], rk, remote, seed, args.timeout)
                seed += 1
        print("paths " + " ".join(paths), flush=True)
        conn.notify(b"bye")
    print("client ok", flush=True)


def refused(what: str, fn) -> str:
    try:
        fn()
    except flagcx_mesh.InvalidArgument as e:
        return str(e)
    raise SystemExit(f"FAILED: {what} was not refused")


def bad(args, dev) -> None:
    with Agent(args.name + "-bad", SECRET, timeout=args.timeout) as a:
        conn, remotes = connect(args, a)
        lbuf = dev.buffer("ipc", SIZE)
        lbuf.write(0, pattern(7, SIZE))
        local = register(a, lbuf)
        remote = remotes["ipc"]
        msgs = [
            refused("a write past the remote end", lambda: conn.write(local, remote, 16, remote_offset=SIZE - 8)),
            refused("a write past the local end", lambda: conn.write(local, remote, 16, local_offset=SIZE - 8)),
            refused("a batch with one bad entry", lambda: conn.batch_write(
                [(local, 0, remote, 0, 4096), (local, 0, remote, SIZE, 1)])),
            refused("this agent's own region as the remote", lambda: conn.write(local, local, 16)),
            refused("garbage bytes as the remote", lambda: conn.write(local, b"\x00" * 40, 16)),
        ]
        check("out of range" in msgs[0] and "out of range" in msgs[1], msgs[:2])
        ask(a, conn, f"check ipc 0 {SIZE} -1", args.timeout)  # nothing of it was written
        conn.write(local, remote, 4096).wait(args.timeout)  # the region works
        ask(a, conn, "dereg ipc", args.timeout)
        # a device path tells a deregistered region by reading its cookie as cma does: where this
        # process may not read the target's memory (ptrace rules) it cannot tell (docs/agent.md)
        if conn.path_to(remotes["host"]) == "cma" or conn.path_to(remote, local) == "staged":
            try:
                conn.write(local, remote, 8192, remote_offset=8192).wait(args.timeout)
                raise SystemExit("FAILED: a write to a deregistered device region went through")
            except flagcx_mesh.InvalidArgument as e:
                msgs.append(str(e))
            ask(a, conn, "check ipc 8192 8192 -1", args.timeout)  # nothing landed after the close
        else:
            print("no cma to the target here: a write to a deregistered region is not checked", flush=True)
        print("refusals: " + " | ".join(m.splitlines()[0] for m in msgs), flush=True)
        conn.notify(b"bye")
    print("bad ok", flush=True)


def pending(args, dev) -> None:
    with Agent(args.name + "-pending", SECRET, timeout=args.timeout) as a:
        conn, remotes = connect(args, a)
        lbuf = dev.buffer("ipc", SIZE)
        local = register(a, lbuf)
        remote = remotes["ipc"]
        conn.write(local, remote, 4096).wait(args.timeout)
        print("ready", flush=True)
        sys.stdin.readline()  # the target is stopped now
        handles = [conn.write(local, remote, SIZE) for _ in range(64)]
        check(not handles[-1].done(), "64 MiB to a stopped target completed")
        print("issued", flush=True)
        sys.stdin.readline()  # the target was killed
        try:
            handles[-1].wait(args.timeout)
            raise SystemExit("FAILED: a write to a killed target completed")
        except flagcx_mesh.PeerLost as e:
            check(args.name in str(e), f"PeerLost does not name {args.name}: {e}")
        check(handles[-1].done(), "a failed handle is not done")
    print("pending ok", flush=True)


def expect_sha(a: Agent, conn, image: bytearray, what: str, timeout: float, region: str = "ipc") -> None:
    """The target's `region` holds `image`, every byte."""
    conn.notify(f"sha {region} 0 {len(image)} {hashlib.sha256(image).hexdigest()}".encode())
    reply = answer(a, timeout)
    check(reply == "ok", f"{what}: {reply}")


def target_counts(a: Agent, conn, request: str, timeout: float) -> dict:
    """serve's answer "ok NAME=N ..." to `request`, by name (None where it says None)."""
    conn.notify(request.encode())
    words = answer(a, timeout).split()
    check(words[0] == "ok", f"{request}: {words}")
    return {k: (None if v == "None" else int(v)) for k, v in (w.split("=") for w in words[1:])}


def target_calls(a: Agent, conn, timeout: float) -> dict:
    return target_counts(a, conn, "calls", timeout)


# Driver calls that take the driver's lock, which every lane's launches and event queries wait for:
# a batch made again takes its staging buffers and copy lists (each with its device address) from
# the pools, on both sides, and asks neither.
POOLED = ("cuMemHostRegister", "cuMemHostGetDevicePointer")
WARM_TRIES = 5  # a repeat may hold more at once than the runs before it (an earlier batch's ring
                # not yet back, more copies in flight): the pools fill up, then a repeat asks nothing


def warm_batch_asks_no_driver_lock(a: Agent, conn, dev, write, timeout: float) -> None:
    """The batch `write` made again, up to WARM_TRIES times: one of the repeats makes neither call
    on either side (asked per chunk, as before, every repeat would)."""
    for _ in range(WARM_TRIES):
        mine, theirs = {n: dev.calls(n) for n in POOLED}, target_calls(a, conn, timeout)
        write()
        after = target_calls(a, conn, timeout)
        made = {n: dev.calls(n) - mine[n] for n in POOLED}
        made_there = {n: after[n] - theirs[n] for n in POOLED}
        if not any(made.values()) and not any(made_there.values()):
            return
    check(False, f"{WARM_TRIES} batches made again each registered host memory or asked its address: the last "
                 f"here {made}, at the target {made_there}")


def blocks_table(rng, n: int, slot: int, max_size: int, size: int = SIZE):
    """n writes of random sizes (1..max_size; max_size alone when fixed) into slots of their own
    (`slot` bytes apart) in shuffled order, from random local places: an (n, 3) table."""
    sizes = rng.integers(1, max_size + 1, n) if max_size < slot else np.full(n, slot)
    t = np.zeros((n, 3), dtype=np.int64)
    t[:, 0] = rng.integers(0, size - sizes + 1)
    t[:, 1] = rng.permutation(n) * slot
    t[:, 2] = sizes
    return t


def whole_region_table(rng, n: int):
    """n writes of random sizes that cover the region exactly (1 MiB: a batch striped over the
    tcp lanes when there are several), in shuffled order, from random local places."""
    cuts = np.sort(rng.choice(np.arange(1, SIZE), n - 1, replace=False)) if n > 1 else np.zeros(0, np.int64)
    starts = np.concatenate([[0], cuts])
    sizes = np.diff(np.concatenate([starts, [SIZE]]))
    order = rng.permutation(n)
    t = np.zeros((n, 3), dtype=np.int64)
    t[:, 1], t[:, 2] = starts[order], sizes[order]
    t[:, 0] = rng.integers(0, SIZE - t[:, 2] + 1)
    return t


def striped_write(conn, rng, write, n: int) -> None:
    """A batch of 1 MiB (Engine::kStripeMinBytes) over a connection of several tcp lanes goes
    over every lane (its bytes counted on this process's sockets, one per lane), parts cut
    anywhere in its blocks; every byte is checked by `write`. With FLAGCX_MESH_CUDA_BATCH_COPY=off
    each write is a staged put of its own, on lane 0."""
    lanes = conn.tcp_lanes
    if os.environ.get("FLAGCX_MESH_CUDA_BATCH_COPY") == "off":
        write("%d write(s) of 1 MiB, no batches" % n, whole_region_table(rng, n))
        print(f"{n} write(s) not striped: batches off", flush=True)
        return
    socks = lane_sockets() if lanes > 1 else []  # (this process connects to the target alone)
    if socks:
        check(len(socks) == lanes, f"{lanes} lane sockets expected, found {len(socks)}")
    before = [bytes_acked(s) for s in socks]
    write("%d write(s) of 1 MiB over %d lane(s)" % (n, lanes), whole_region_table(rng, n))
    if socks:
        part = SIZE // lanes
        sent = acked_since(socks, before, part)
        for s in socks:
            s.close()
        check(all(part <= k <= SIZE - part * (lanes - 1) + n * 24 + 8192 for k in sent),
              f"each of {lanes} lanes should carry about {part} bytes of the batch: {sent}")
        print(f"{n} write(s) striped over {lanes} lanes: {sent}", flush=True)


def staged_source(args, a: Agent, dev, rng, region: str):
    """Connects `a` to the target; a device region here filled with random bytes (`src`), and
    the target's `region` ("ipc", "host"), which a write reaches over staged (forced in the tests):
    (conn, local, remote, src)."""
    conn, remotes = connect(args, a)
    lbuf = dev.buffer("ipc", SIZE)
    src = rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    lbuf.write(0, src)
    local, remote = register(a, lbuf), remotes[region]
    path = conn.path_to(remote, local)
    check(path == "staged", f"the batch must take staged (FLAGCX_MESH_CUDA_PATH), not {path}")
    return conn, local, remote, src


def blocks_role(args, dev) -> None:
    """Batches of staged writes and reads (write_blocks / read_blocks over staged, one frame a
    batch): 1 block, blocks straddling the staging chunks (FLAGCX_MESH_STAGED_CHUNK_BYTES=65536
    in the tests), mixed sizes, 100,000 blocks (two frames); every byte checked at the target
    (writes) or here (reads); blocks of one batch landing on each other's bytes land in call order
    (the later wins). On the fake driver the side that gathers makes one launch per chunk and so
    does the side that scatters. A block crossing the region's end is refused naming the
    op, nothing written; a batch to (from) a region the target deregistered is refused there
    naming the block and the peer, nothing written."""
    rng = np.random.default_rng(35)
    with Agent(args.name + "-blocks", SECRET, timeout=args.timeout) as a:
        conn, local, remote, src = staged_source(args, a, dev, rng, "ipc")
        image = bytearray(SIZE)
        kernel = os.environ.get("FLAGCX_MESH_CUDA_BATCH_COPY", "auto") in ("auto", "kernel")

        def write(what, t):
            conn.write_blocks(local, remote, t).wait(args.timeout)
            for lo, ro, n in t.tolist():
                image[ro:ro + n] = src[lo:lo + n]
            expect_sha(a, conn, image, what, args.timeout)

        write("one block", np.array([[100, 5000, 3000]]))
        write("mixed sizes", blocks_table(rng, 300, 3000, 2999))
        mine, theirs = dev.calls("cuLaunchKernel"), target_calls(a, conn, args.timeout)
        mine_copies = dev.calls("cuMemcpyAsync")
        t = blocks_table(rng, 200, 3001, 3001)  # 600,200 bytes: 10 chunks of 64 KiB, blocks straddling them
        write("blocks straddling chunks", t)
        chunks = (int(t[:, 2].sum()) + 65535) // 65536
        if mine is not None and kernel and os.environ.get("FLAGCX_MESH_STAGED_CHUNK_BYTES") == "65536":
            # through device scratch: each chunk also crosses the bus in one copy (down, then up)
            bus = chunks if os.environ.get("FLAGCX_MESH_STAGED_BOUNCE") == "on" else 0
            after = target_calls(a, conn, args.timeout)
            check(dev.calls("cuLaunchKernel") - mine == chunks and dev.calls("cuMemcpyAsync") - mine_copies == bus,
                  f"{chunks} gathers and {bus} copies expected, {dev.calls('cuLaunchKernel') - mine} launches "
                  f"and {dev.calls('cuMemcpyAsync') - mine_copies} copies made")
            check(after["cuLaunchKernel"] - theirs["cuLaunchKernel"] == chunks and
                  after["cuMemcpyAsync"] - theirs["cuMemcpyAsync"] == bus,
                  f"the target: one scatter launch per chunk ({chunks}) and {bus} copies expected: {theirs} -> {after}")
            warm_batch_asks_no_driver_lock(a, conn, dev, lambda: write("the same blocks again", t), args.timeout)
        write("100,000 blocks", blocks_table(rng, 100_000, 8, 8))
        striped_write(conn, rng, write, 300)
        striped_write(conn, rng, write, 1)  # one write of 1 MiB: as a batch, striped too
        # blocks of one batch landing on each other's bytes: the later wins, as one op after the
        # other (one launch does not order its copies; the fake's runs them last to first)
        write("writes onto the same bytes", np.array([[0, 50000, 4096], [10000, 50000, 4096],
                                                      [20000, 52048, 4096], [30000, 60000, 100]]))
        back = dev.buffer("ipc", SIZE)
        into = register(a, back)

        def read(what, t, count=False):
            """t: (local slot, remote place, size) rows; the blocks read back land in their slots."""
            back.write(0, bytes(SIZE))
            want = bytearray(SIZE)
            for lo, ro, n in t.tolist():
                want[lo:lo + n] = image[ro:ro + n]
            mine, theirs = dev.calls("cuLaunchKernel"), target_calls(a, conn, args.timeout)
            # (batches off, each row is a staged get of its own, all in flight at once: the wait
            # covers them all, 100,000 answered one after another by the target)
            conn.read_blocks(into, remote, t).wait(args.timeout * max(1, len(t) // 10_000))
            check(back.read(0, SIZE) == bytes(want), f"{what}: wrong bytes read back")
            if count and mine is not None and kernel and os.environ.get("FLAGCX_MESH_STAGED_CHUNK_BYTES") == "65536":
                after, chunks = target_calls(a, conn, args.timeout), (int(t[:, 2].sum()) + 65535) // 65536
                check(dev.calls("cuLaunchKernel") - mine == chunks, f"{what}: {chunks} scatters expected here, "
                      f"{dev.calls('cuLaunchKernel') - mine} launches made")
                check(after["cuLaunchKernel"] - theirs["cuLaunchKernel"] == chunks and
                      after["cuMemcpyAsync"] == theirs["cuMemcpyAsync"],
                      f"{what}: the target: one gather launch per chunk ({chunks}), no copy: {theirs} -> {after}")

        def swapped(t):  # the same rows as reads: local slots where the writes' remote places were
            r = t.copy()
            r[:, 0], r[:, 1] = t[:, 1], rng.integers(0, SIZE - t[:, 2] + 1)
            return r

        read("one block read", np.array([[7000, 5000, 3000]]))
        read("reads straddling chunks", swapped(blocks_table(rng, 200, 3001, 3001)), count=True)
        read("mixed-size reads", swapped(blocks_table(rng, 300, 3000, 2999)))
        read("100,000 reads", swapped(blocks_table(rng, 100_000, 8, 8)))
        read("reads into the same bytes", np.array([[7000, 0, 4096], [7000, 8192, 4096], [9000, 20000, 100]]))
        bad_table = np.array([[0, 0, 4096], [0, SIZE - 100, 200]])
        msg = refused("a block crossing the region's end", lambda: conn.write_blocks(local, remote, bad_table))
        check("op 1" in msg and "out of range" in msg, msg)
        expect_sha(a, conn, image, "after a refused batch", args.timeout)
        ask(a, conn, "dereg ipc", args.timeout)
        msg = refused("a batch to a deregistered region",
                      lambda: conn.write_blocks(local, remote, blocks_table(rng, 10, 4096, 4096)).wait(args.timeout))
        one_frame = os.environ.get("FLAGCX_MESH_CUDA_BATCH_COPY") != "off"  # off: a staged put per op
        check(("block 0 of a batch of 10 staged writes" in msg or not one_frame) and "deregistered" in msg
              and "agent " + args.name in msg, msg)
        rmsg = refused("a batch of reads from a deregistered region",
                       lambda: conn.read_blocks(into, remote, blocks_table(rng, 10, 4096, 4096)).wait(args.timeout))
        check(("block 0 of a batch of 10 staged reads" in rmsg or not one_frame) and "deregistered" in rmsg
              and "agent " + args.name in rmsg, rmsg)
        expect_sha(a, conn, image, "after a batch the target refused", args.timeout)
        print("blocks refused: " + msg.splitlines()[0], flush=True)
        conn.notify(b"bye")
    print("blocks ok", flush=True)


def blocks_scatter_fails(args, dev) -> None:
    """Striped batches of 1 MiB (several tcp lanes) to a target whose scatters fail for a while
    (its FXM_FAKECUDA_FAIL): each such batch is refused, naming the batch, whichever lane's part
    failed; the connection stays up, and once the target's copies work again a batch lands whole."""
    rng = np.random.default_rng(7)
    with Agent(args.name + "-scatter", SECRET, timeout=args.timeout) as a:
        conn, remotes = connect(args, a)
        check(conn.tcp_lanes > 1, f"several tcp lanes expected, not {conn.tcp_lanes}")
        lbuf = dev.buffer("ipc", SIZE)
        src = rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes()
        lbuf.write(0, src)
        local, remote = register(a, lbuf), remotes["ipc"]
        refusals = []
        for attempt in range(20):
            t = whole_region_table(rng, 300)
            try:
                conn.write_blocks(local, remote, t).wait(args.timeout)
            except flagcx_mesh.InvalidArgument as e:
                check("staged writes" in str(e), f"the refusal does not name the batch: {e}")
                check(not conn.gone(), f"the connection went with a refused batch: {conn.gone()}")
                refusals.append(str(e).splitlines()[0])
                continue
            image = bytearray(SIZE)
            for lo, ro, n in t.tolist():
                image[ro:ro + n] = src[lo:lo + n]
            expect_sha(a, conn, image, "the batch after the refused ones", args.timeout)
            break
        else:
            raise SystemExit(f"FAILED: no batch landed in 20 attempts: {refusals[-1:]}")
        check(refusals, "no batch was refused: the target's copies did not fail")
        print(f"refused {len(refusals)}: {refusals[0]}", flush=True)
        conn.notify(b"bye")
    print("blocks-scatter ok", flush=True)


def blocks_refused(args, dev) -> None:
    """Batches to a target that refuses every staged landing (a setting it does not take): each
    call fails with InvalidArgument, saying why, and the connection stays up for the next."""
    with Agent(args.name + "-refused", SECRET, timeout=args.timeout) as a:
        conn, remotes = connect(args, a)
        lbuf = dev.buffer("ipc", SIZE)
        local, remote = register(a, lbuf), remotes["ipc"]
        table = whole_region_table(np.random.default_rng(3), 64)
        for attempt in range(2):
            try:
                conn.write_blocks(local, remote, table).wait(args.timeout)
                raise SystemExit("FAILED: a batch landed at a target that refuses every landing")
            except flagcx_mesh.InvalidArgument as e:
                check(not conn.gone(), f"the connection went with a refused batch: {conn.gone()}")
                print(f"refused {attempt}: {e}", flush=True)
        conn.notify(b"bye")
    print("blocks-refused ok", flush=True)


def blocks_host(args, dev) -> None:
    """Batches of staged writes from device memory into the target's host region: gathered here
    as any staged batch (one launch a chunk on the fake driver), sent as one frame (striped over
    the lanes from 1 MiB), landed in place there (no launch, no copy at the target); every byte
    checked. Reads from a host region are staged gets of their own (the target gathers only
    from device memory), every byte checked."""
    rng = np.random.default_rng(36)
    with Agent(args.name + "-host", SECRET, timeout=args.timeout) as a:
        conn, local, remote, src = staged_source(args, a, dev, rng, "host")
        image = bytearray(SIZE)

        def write(what, t):
            conn.write_blocks(local, remote, t).wait(args.timeout)
            for lo, ro, n in t.tolist():
                image[ro:ro + n] = src[lo:lo + n]
            expect_sha(a, conn, image, what, args.timeout, region="host")

        write("one block", np.array([[100, 5000, 3000]]))
        t = blocks_table(rng, 200, 3001, 3001)  # 600,200 bytes: 10 chunks of 64 KiB, blocks straddling them
        mine, theirs = dev.calls("cuLaunchKernel"), target_calls(a, conn, args.timeout)
        write("blocks straddling chunks", t)
        if mine is not None and os.environ.get("FLAGCX_MESH_STAGED_CHUNK_BYTES") == "65536":
            chunks, after = (int(t[:, 2].sum()) + 65535) // 65536, target_calls(a, conn, args.timeout)
            check(dev.calls("cuLaunchKernel") - mine == chunks, f"{chunks} gathers expected here, "
                  f"{dev.calls('cuLaunchKernel') - mine} launches made")
            check(after == theirs, f"the target lands host blocks in place: no launch, no copy: {theirs} -> {after}")
            warm_batch_asks_no_driver_lock(a, conn, dev, lambda: write("the same blocks again", t), args.timeout)
        write("mixed sizes", blocks_table(rng, 300, 3000, 2999))
        write("100,000 blocks", blocks_table(rng, 100_000, 8, 8))
        striped_write(conn, rng, write, 300)
        back = dev.buffer("ipc", SIZE)
        into = register(a, back)
        t = blocks_table(rng, 50, 9000, 8999)
        want = bytearray(SIZE)
        for lo, ro, n in t.tolist():
            want[lo:lo + n] = image[ro:ro + n]
        conn.read_blocks(into, remote, t).wait(args.timeout)
        check(back.read(0, SIZE) == bytes(want), "reads from the host region: wrong bytes read back")
        conn.notify(b"bye")
    print("blocks-host ok", flush=True)


def blocks_lost(args, dev) -> None:
    """A batch of 4096 staged writes (64 MiB; --expect read: reads) to (from) a target that stops
    reading and is killed: the call fails with PeerLost naming it, within its timeout. --expect
    timeout: the target is only stopped; the call fails at its deadline, its frames' parts given
    up on every lane, and the connection is lost (no process fails on the way)."""
    with Agent(args.name + "-lost", SECRET, timeout=args.timeout) as a:
        conn, remotes = connect(args, a)
        lbuf = dev.buffer("ipc", SIZE)
        local, remote = register(a, lbuf), remotes["ipc"]
        conn.write_blocks(local, remote, np.array([[0, 0, 4096], [4096, 4096, 4096]])).wait(args.timeout)
        print("ready", flush=True)
        sys.stdin.readline()  # the target is stopped now
        t = np.zeros((4096, 3), dtype=np.int64)
        t[:, 0] = t[:, 1] = (np.arange(4096) % 64) * 16384
        t[:, 2] = 16384
        print("issuing", flush=True)
        try:
            if args.expect == "read":
                conn.read_blocks(local, remote, t).wait(args.timeout)
            else:
                conn.write_blocks(local, remote, t).wait(args.timeout)
            raise SystemExit("FAILED: a batch to a killed target completed")
        except flagcx_mesh.MeshTimeout as e:
            check(args.expect == "timeout", f"a timeout, not the expected {args.expect}: {e}")
            end = time.monotonic() + args.timeout
            while not conn.gone() and time.monotonic() < end:  # the parts it gave up lose the peer
                time.sleep(0.01)
            check(bool(conn.gone()), "the connection is not lost after its staged frames were given up")
            print(f"timed out: {str(e).splitlines()[0]}; gone: {conn.gone()}", flush=True)
            from flagcx_mesh.cuda import staged_waits

            print("staged waits " + json.dumps(staged_waits()), flush=True)
        except flagcx_mesh.PeerLost as e:
            check(args.name in str(e), f"PeerLost does not name {args.name}: {e}")
            print(f"lost: {str(e).splitlines()[0]}", flush=True)
    print("blocks-lost ok", flush=True)


def connected_tcp_fds():
    """This process's connected TCP sockets (an agent with one connection of one lane: its fds)."""
    import socket

    from meshutil import stream_fds

    out = []
    for fd, s in stream_fds():
        if s.family in (socket.AF_INET, socket.AF_INET6):
            out.append(fd)
        s.close()
    return out


def blocks_forged(args, dev) -> None:
    """A peer that writes a batch frame (kPutBlocks) of its own naming a block past the region's
    end, which this library's initiator never sends: the target checks every block before any
    lands, refuses the batch (its log names the block) and leaves the region as it was, checked by
    a second agent (the first one's connection is out of step after the forgery)."""
    import socket
    import struct

    from flagcx_mesh.agent import region_info

    with Agent(args.name + "-forger", SECRET, timeout=args.timeout) as a:
        conn, remotes = connect(args, a)
        local, remote = register(a, dev.buffer("ipc", SIZE)), remotes["ipc"]
        conn.write_blocks(local, remote, np.array([[0, 0, 4096], [0, 8192, 4096]])).wait(args.timeout)  # zeros
        fds = connected_tcp_fds()
        check(fds, "no connected socket found")
        win = region_info(remote)["index"]
        body = struct.pack("<IIQ", 2, 0, 32) + struct.pack("<IIQQ", win, 0, 0, 16) + \
            struct.pack("<IIQQ", win, 0, SIZE - 8, 16) + b"\xab" * 32
        s = socket.socket(fileno=os.dup(fds[0]))
        s.sendall(struct.pack("<IHHQ", 0x464D5846, 12, 0, len(body)) + body)
        s.close()
        time.sleep(1.0)  # the target reads it before this agent's goodbye
    with Agent(args.name + "-checker", SECRET, timeout=args.timeout) as b:
        conn, _ = connect(args, b)
        expect_sha(b, conn, bytearray(SIZE), "after a forged batch with a block past the end", args.timeout)
        conn.notify(b"bye")
    print("blocks-forged ok", flush=True)


READS = 2000  # staged reads of 8 B in flight together (reads, reads-timed)


def reads_source(args, a: Agent, dev):
    """The target's region holding a random source's bytes, and a device region here to read them
    into, the answers' path warm: (conn, remote, into, back, src)."""
    conn, local, remote, src = staged_source(args, a, dev, np.random.default_rng(8), "ipc")
    conn.write(local, remote, SIZE).wait(args.timeout)  # the target's region: src's bytes
    back = dev.buffer("ipc", SIZE)
    into = register(a, back)
    conn.read(into, remote, 8).wait(args.timeout)
    return conn, remote, into, back, src


def issue_reads(conn, into, remote, n: int = READS) -> list:
    """n reads of 8 B, the k-th into slot k from the (n-1-k)-th 8 bytes of the remote region."""
    return [conn.read(into, remote, 8, 8 * i, 8 * (n - 1 - i)) for i in range(n)]


def check_reads(back, src, n: int = READS) -> None:
    want = b"".join(src[8 * (n - 1 - i):8 * (n - i)] for i in range(n))
    check(back.read(0, 8 * n) == want, "the reads' bytes")


def reads_role(args, dev) -> None:
    """Staged reads from the target's device region into device memory here, one op each
    (conn.read), issued while the target is stopped: each call returns at once with its handle
    not done (until 2026-12-07 a staged read into device memory returned only once its bytes were
    in place, so reads in a row went one round trip at a time, ~100 us each on the fake driver,
    and the first call here waited out its deadline). The target continued, every read completes
    and every byte is checked. The role prints "ready", then waits for a line on stdin (the
    target stopped), issues, prints "issued", and waits for a second line (the target continued)."""
    with Agent(args.name + "-reads", SECRET, timeout=args.timeout) as a:
        conn, remote, into, back, src = reads_source(args, a, dev)
        print("ready", flush=True)
        sys.stdin.readline()
        t0 = time.monotonic()
        handles = issue_reads(conn, into, remote)
        issued = time.monotonic() - t0
        done = sum(h.done() for h in handles)
        check(done == 0, f"{done} of {READS} reads from a stopped target are done")
        print(f"issued {READS} staged reads of 8 B in {issued * 1e3:.0f} ms, none done", flush=True)
        print("issued", flush=True)
        sys.stdin.readline()
        for h in handles:
            h.wait(args.timeout)
        check_reads(back, src)
        conn.notify(b"bye")
    print("reads ok", flush=True)


def reads_timed(args, dev) -> None:
    """The figures of staged reads of 8 B into device memory (scripts/test-gpu.sh's
    agent-staged-blocks step): 300 one at a time (each waited), then 2000 issued at once and
    waited, every byte checked; prints each form's microseconds an op. No figure is asserted."""
    with Agent(args.name + "-reads-timed", SECRET, timeout=args.timeout) as a:
        conn, remote, into, back, src = reads_source(args, a, dev)
        t0 = time.perf_counter()
        for i in range(300):
            conn.read(into, remote, 8, 8 * i, 8 * (READS - 1 - i)).wait(args.timeout)
        one = (time.perf_counter() - t0) / 300
        t0 = time.perf_counter()
        for h in issue_reads(conn, into, remote):
            h.wait(args.timeout)
        together = (time.perf_counter() - t0) / READS
        check_reads(back, src)
        print(f"staged reads of 8 B into device memory: one at a time {one * 1e6:.1f} us an op, "
              f"{READS} in flight {together * 1e6:.1f} us an op", flush=True)
        conn.notify(b"bye")
    print("reads-timed ok", flush=True)


def read_lost(args, dev) -> None:
    """A staged read of the target's whole device region (16 chunks of 64 KiB) that fails once its
    first chunk landed, while more of its copies up are queued (fake driver only; the test slows them:
    FXM_FAKECUDA_COPY_TO_DEVICE_DELAY_MS here, _FROM_ in the target): the target is killed (the
    role prints "landing" for the test to kill it), or with --expect close this side closes the
    connection, or the test stops the target and a new incarnation of its name appears: with
    --expect superseded this side connects to it (its files in DIR/second), with superseded-in
    it connects here (the `dial` role; this side's metadata in DIR/reader.meta): the old
    connection is retired. Once the handle is done (polled) the wait fails naming the peer, and
    no copy up of the read writes into its destination after that (the bytes there the same 2.5
    copies up later, 1 s at least): the copies already queued ended before the failure showed."""
    chunk = 65536
    with Agent(args.name + "-read-lost", SECRET, timeout=args.timeout) as a:
        publish(args.dir, "reader.meta", a.metadata())
        conn, remote, into, back, src = reads_source(args, a, dev)
        copies = dev.calls("cuMemcpyAsync")
        h = conn.read(into, remote, SIZE)
        # The fifth chunk's copy up is queued once the first one's landed (a ring of 4 landing
        # buffers): counted, not looked for in the destination, which copies are writing.
        end = time.monotonic() + args.timeout
        while dev.calls("cuMemcpyAsync") - copies < 5:
            check(time.monotonic() < end, "the read's fifth chunk was never queued to land")
            time.sleep(0.005)
        print("landing", flush=True)
        if args.expect == "close":
            conn.close()
        elif args.expect == "superseded":
            second = os.path.join(args.dir, "second")
            a.connect(read_published(second, f"{args.name}.meta", FILE_TIMEOUT), timeout=args.timeout)
        while not h.done():  # a poller learns of the end as early as a waiter
            check(time.monotonic() < end + args.timeout, "the failed read is never done")
            time.sleep(0.001)
        seen = back.read(0, SIZE)
        try:
            h.wait(args.timeout)
            raise SystemExit("FAILED: a read from a killed target, or on a closed connection, completed")
        except flagcx_mesh.PeerLost as e:
            check(args.name in str(e), f"PeerLost does not name {args.name}: {e}")
            why = str(e).splitlines()[0]
        time.sleep(max(1.0, 2.5 * float(os.environ.get("FXM_FAKECUDA_COPY_TO_DEVICE_DELAY_MS", "0")) / 1e3))
        check(back.read(0, SIZE) == seen, "a copy up wrote into the read's destination after it failed")
        landed = sum(1 for k in range(0, SIZE, chunk) if seen[k:k + chunk] == src[k:k + chunk])
        check(1 <= landed < SIZE // chunk, f"{landed} chunks landed: the read did not fail mid-answer")
        print(f"lost: {landed} of {SIZE // chunk} chunks had landed; nothing after ({why})", flush=True)
    print("read-lost ok", flush=True)


def dial_role(args, dev) -> None:
    """A new incarnation of NAME that connects to the read-lost role (DIR/reader.meta) once its
    stdin says "go" (the old one stopped by then), then stays until its stdin ends."""
    with Agent(args.name, SECRET, timeout=args.timeout) as a:
        print("ready", flush=True)
        sys.stdin.readline()
        a.connect(read_published(args.dir, "reader.meta", FILE_TIMEOUT), timeout=args.timeout)
        print("connected", flush=True)
        sys.stdin.readline()
    print("dial ok", flush=True)


def stream_role(args, dev) -> None:
    """Writes and reads ordered on a busy stream: a write copies what the stream put in its
    source first, a read lands after the stream cleared its destination."""
    with Agent(args.name + "-stream", SECRET, timeout=args.timeout) as a:
        conn, remotes = connect(args, a)
        n = 200_003
        src, zeros, lbuf = dev.buffer("ipc", n), dev.buffer("ipc", n), dev.buffer("ipc", n)
        local = register(a, lbuf)
        s = dev.stream()
        paths = []
        for seed, (rk, remote) in enumerate(remotes.items(), start=70):
            paths.append(f"dev:{rk}={conn.path_to(remote, local)}")
            src.write(0, pattern(seed, n))
            lbuf.write(0, bytes(n))
            dev.delay(s, 0.3)  # a write not ordered on the stream copies zeros
            dev.copy_async(lbuf, 0, src, 0, n, s)
            conn.write(local, remote, n, stream=s, notification=f"check {rk} 0 {n} {seed}".encode()).wait(args.timeout)
            reply = answer(a, args.timeout)
            check(reply == "ok", f"a write on a stream to {rk}: {reply}")
            lbuf.write(0, pattern(seed + 100, n))
            dev.delay(s, 0.3)  # a read not ordered on the stream is wiped by the clearing copy
            dev.copy_async(lbuf, 0, zeros, 0, n, s)
            conn.read(local, remote, n, stream=s).wait(args.timeout)
            dev.sync(s)
            check(lbuf.read(0, n) == pattern(seed, n), f"a read on a stream from {rk}: wrong bytes")
        print("paths " + " ".join(paths), flush=True)
        conn.notify(b"bye")
    print("stream ok", flush=True)


def self_pair(args, dev) -> None:
    """Two agents in this process: device and host regions of one reached from the other."""
    with Agent("owner", SECRET, timeout=args.timeout) as owner, Agent("user", SECRET, timeout=args.timeout) as user:
        obufs = {k: dev.buffer(k, SIZE) for k in dev.kinds}
        obufs["host"] = HostBuf(SIZE)
        remotes = {k: register(owner, b) for k, b in obufs.items()}
        check(remotes["ipc"].kind == "device" and remotes["ipc"].view is None, "a device region has no host view")
        conn = user.connect(owner.metadata())
        lbufs = {"host": HostBuf(SIZE), "dev": dev.buffer("ipc", SIZE)}
        seed, paths = 40, []
        for lk, lb in lbufs.items():
            local = register(user, lb)
            for rk, remote in remotes.items():
                if lk == "host" and rk == "host":
                    continue
                path = conn.path_to(remote, local)
                paths.append(f"{lk}:{rk}={path}")
                check(path == "cuda-self", f"{lk} -> {rk}: {path}, expected cuda-self")
                n, roff = 65_537, 123
                lb.write(0, pattern(seed, n))
                conn.write(local, remote, n, remote_offset=roff).wait(args.timeout)
                check(obufs[rk].read(roff, n) == pattern(seed, n), f"{lk} -> {rk}: wrong bytes")
                lb.write(0, bytes(n))
                conn.read(local, remote, n, remote_offset=roff).wait(args.timeout)
                check(lb.read(0, n) == pattern(seed, n), f"{lk} <- {rk}: wrong bytes")
                seed += 1
        owner.deregister(remotes["ipc"])
        refused("a write to a deregistered region", lambda: conn.write(user.register(lbufs["host"].a), remotes["ipc"], 8).wait())
        print("paths " + " ".join(paths), flush=True)
    print("self ok", flush=True)


DEREG_BYTES = 8 << 20


def dereg_owner(args, dev) -> None:
    """Owns a device region that a dereg-reader reads over staged, the copies from the device
    slowed by the fake driver (FXM_FAKECUDA_COPY_FROM_DEVICE_DELAY_MS); once the answer's copies
    down are queued it deregisters the region and frees its memory at once, as an application
    may once deregister returned. The deregistration must wait for those copies."""
    with Agent(args.name, SECRET, timeout=args.timeout) as a:
        src = dev.buffer("ipc", DEREG_BYTES)
        src.write(0, pattern(7, DEREG_BYTES))
        region = register(a, src)
        queued = dev.cu.calls("cuMemcpyAsync")
        publish(args.dir, f"{args.name}.ipc", region.descriptor)
        publish(args.dir, f"{args.name}.meta", a.metadata())
        end = time.monotonic() + args.timeout
        while dev.cu.calls("cuMemcpyAsync") < queued + 2:  # the answer's two 4 MiB chunks
            check(time.monotonic() < end, "the reader's get never reached this agent")
            time.sleep(0.001)
        a.deregister(region, timeout=args.timeout)
        dev.cu.free(src.ptr)
        got = a.notifications(timeout=args.timeout)
        check([n.data for n in got] == [b"bye"], f"the reader's goodbye expected, got {got}")
    print("dereg-owner ok", flush=True)


def dereg_reader(args, dev) -> None:
    """Reads the dereg-owner's device region into host memory and checks every byte."""
    with Agent(args.name + "-reader", SECRET, timeout=args.timeout) as a:
        conn, remotes = connect(args, a)
        dst = HostBuf(DEREG_BYTES)
        local = register(a, dst)
        path = conn.path_to(remotes["ipc"], local)
        check(path == "staged", f"the read must take staged (FLAGCX_MESH_CUDA_PATH), not {path}")
        conn.read(local, remotes["ipc"], DEREG_BYTES).wait(args.timeout)
        check(dst.read(0, DEREG_BYTES) == pattern(7, DEREG_BYTES), "the read got the wrong bytes")
        conn.notify(b"bye")
    print("dereg-reader ok", flush=True)


def run_pair(args, dev) -> None:
    """For scripts/test-gpu.sh: each role of --roles in its own process against a fresh serve
    process (self: alone), every process bounded by a deadline."""
    import subprocess
    import tempfile

    def role_cmd(role, d):
        return [sys.executable, os.path.abspath(__file__), role, d, "owner", "--device", args.device,
                "--timeout", str(args.timeout)]

    for role in args.roles.split(","):
        with tempfile.TemporaryDirectory() as d:
            serve = role_cmd("serve", d) + (["--waits"] if role == "waits" else [])
            procs = [] if role == "self" else [("serve", subprocess.Popen(serve))]
            procs.append((role, subprocess.Popen(role_cmd(role, d))))
            for name, p in reversed(procs):
                try:
                    rc = p.wait(timeout=args.timeout * 6)
                except subprocess.TimeoutExpired:
                    for _, q in procs:
                        q.kill()
                    raise SystemExit(f"FAILED: {role}: {name} hung")
                check(rc == 0, f"{role}: {name} exited {rc}")
        print(f"pair {role} passed", flush=True)
    print("pair ok", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    roles = {"serve": serve, "client": client, "bad": bad, "pending": pending, "stream": stream_role, "self": self_pair,
             "reads": reads_role, "reads-timed": reads_timed, "read-lost": read_lost, "dial": dial_role,
             "pair": run_pair,
             "dereg-owner": dereg_owner, "dereg-reader": dereg_reader, "blocks": blocks_role,
             "blocks-lost": blocks_lost, "blocks-forged": blocks_forged, "blocks-scatter": blocks_scatter_fails,
             "blocks-refused": blocks_refused, "blocks-host": blocks_host, "waits": waits_role}
    p.add_argument("role", choices=list(roles))
    p.add_argument("dir", nargs="?", default="")
    p.add_argument("name", nargs="?", default="owner")
    p.add_argument("--device", choices=["fake", "torch"], default="fake")
    p.add_argument("--expect", default="")
    p.add_argument("--waits", action="store_true", help="serve: wait_notification for the peer of the first one")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--roles", default="client,bad,stream,self", help="pair: the roles to run")
    args = p.parse_args()
    dev = None if args.role == "pair" else make_device(args.device)
    roles[args.role](args, dev)


if __name__ == "__main__":
    main()
