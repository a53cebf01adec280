"""Batched device copies of one agent call (transport/cuda/copy_batch.h), two agents in this
process (cuda-self), for tests/test_agent_batch_fake.py (the fake CUDA driver, which runs the
copies of one cuMemcpyBatchAsync last to first) and scripts/test-gpu.sh (--device torch).

    batched   64 device->device writes of 4 KiB to reversed offsets land; on the fake: one
              batch call (a launch of the copy kernel, or with FLAGCX_MESH_CUDA_BATCH_COPY=driver
              one cuMemcpyBatchAsync), no cuMemcpyAsync, one event; a host-memory op in the
              middle of a batch splits it (two batch calls, one cuMemcpyAsync)
    mixed     one call of ~100 writes of random sizes (1 byte to 300 KiB: several chunks of the
              kernel) from and to unaligned offsets, in shuffled order: every byte lands
    overlap   ops of one call that touch each other's bytes keep their order: a later write
              to the same bytes wins (write after write), a write that reads what an earlier
              one wrote sees it (read after write), one that overwrites what an earlier one
              reads does not change what that one read (write after read), a later read into
              the same local bytes wins
    stream    a batch on a busy stream copies only after the stream's earlier work
    off       (FLAGCX_MESH_CUDA_BATCH_COPY=off) one cuMemcpyAsync per op, one event, same bytes
    refused   (FLAGCX_MESH_CUDA_BATCH_COPY=driver, the fake's cuMemcpyBatchAsync fails) the
              copies go one at a time, same bytes, and later batches do not call it again
    no-kernel (the fake's cuLaunchKernel or cuModuleLoadData fails) batches go through
              cuMemcpyBatchAsync, same bytes, and the kernel is not tried again
    cross-device (two devices) the user's memory on device 1, the owner's on device 0: the
              kernel cannot take the run, which goes through one cuMemcpyBatchAsync
Each prints "<scenario> ok" when it passed; any failure exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import random

from flagcx_mesh.agent import Agent
from agent_device_prog import HostBuf, check, make_device, pattern, register

SECRET = "agent-batch-secret"
BLOCK = 4096
SIZE = 1 << 20
ISSUE_BYTES = 32 << 20  # a call's queued copies are issued once they hold this many bytes (Connection::Batch::kIssueBytes)


def launches(sizes) -> int:
    """The launches (and events) of a call of disjoint device copies of these sizes, in order
    (size-0 ones copy nothing): one each time the copies queued since the last hold ISSUE_BYTES,
    and one for the rest."""
    n, queued = 0, 0
    for size in (int(v) for v in sizes):
        if size == 0:
            continue
        queued += size
        if queued >= ISSUE_BYTES:
            n, queued = n + 1, 0
    return n + (queued > 0)


class Calls:
    """Driver calls made since the last look (fake driver only; None on a real one)."""

    NAMES = ("cuLaunchKernel", "cuMemcpyBatchAsync", "cuMemcpyAsync", "cuEventRecord")

    def __init__(self, dev):
        self.cu = getattr(dev, "cu", None)
        self.last = self.now()

    def now(self):
        return None if self.cu is None else {n: self.cu.calls(n) for n in self.NAMES}

    def since(self):
        now = self.now()
        if now is None:
            return None
        d = {n: now[n] - self.last[n] for n in self.NAMES}
        self.last = now
        return d


def batch_call() -> str:
    """The driver call that issues a run of copies: the kernel's launch unless told otherwise."""
    return "cuMemcpyBatchAsync" if os.environ.get("FLAGCX_MESH_CUDA_BATCH_COPY") == "driver" else "cuLaunchKernel"


def expect_calls(calls: Calls, what: str, batches=None, **want) -> None:
    """`batches`: how many batch calls (batch_call()); the other one is expected not to be made."""
    if batches is not None:
        other = "cuMemcpyBatchAsync" if batch_call() == "cuLaunchKernel" else "cuLaunchKernel"
        want = {batch_call(): batches, other: 0, **want}
    got = calls.since()
    if got is None:
        return  # a real driver: the bytes are what is checked
    check(all(got[k] == v for k, v in want.items()), f"{what}: driver calls {got}, expected {want}")


class Pair:
    """Two agents, a connection, an owner's device region and the user's device and host regions."""

    def __init__(self, args, dev, lbuf=None):
        self.dev, self.timeout = dev, args.timeout
        self.owner = Agent("owner", SECRET, timeout=args.timeout)
        self.user = Agent("user", SECRET, timeout=args.timeout)
        self.rbuf, self.hbuf = dev.buffer("ipc", SIZE), HostBuf(SIZE)
        self.lbuf = dev.buffer("ipc", SIZE) if lbuf is None else lbuf
        self.remote = register(self.owner, self.rbuf)
        self.local = register(self.user, self.lbuf)
        self.host = register(self.user, self.hbuf)
        self.conn = self.user.connect(self.owner.metadata())
        path = self.conn.path_to(self.remote, self.local)
        check(path == "cuda-self", f"the path is {path}, expected cuda-self")

    def close(self):
        self.user.close()
        self.owner.close()

    def write(self, ops, **kw):
        self.conn.batch_write(ops, **kw).wait(self.timeout)

    def block(self, buf, i: int) -> bytes:
        return buf.read(i * BLOCK, BLOCK)


def fill(buf, seed: int) -> bytes:
    data = pattern(seed, SIZE)
    buf.write(0, data)
    return data


def blk(data: bytes, i: int) -> bytes:
    return data[i * BLOCK:(i + 1) * BLOCK]


def reversed_writes(p: Pair, n: int, seed: int, what: str) -> None:
    src = fill(p.lbuf, seed)
    p.rbuf.write(0, bytes(n * BLOCK))
    p.write([(p.local, i * BLOCK, p.remote, (n - 1 - i) * BLOCK, BLOCK) for i in range(n)])
    for i in range(n):
        check(p.block(p.rbuf, n - 1 - i) == blk(src, i), f"{what}: block {i} did not land at {n - 1 - i}")


def batched(args, dev) -> None:
    p = Pair(args, dev)
    calls = Calls(dev)
    reversed_writes(p, 64, 1, "64 writes")
    expect_calls(calls, "one call of 64 device writes", batches=1, cuMemcpyAsync=0, cuEventRecord=1)
    # a call of many small copies: one launch; of 1200 x 64 KiB: issued every 32 MiB (512 of them),
    # the device copying those while the rest are queued
    many = [(p.local, i * 512, p.remote, (1199 - i) * 512, 512) for i in range(1200)]
    src = fill(p.lbuf, 8)
    p.rbuf.write(0, bytes(SIZE))
    calls.since()
    p.write(many)
    expect_calls(calls, "one call of 1200 device writes of 512 bytes", batches=1, cuMemcpyAsync=0, cuEventRecord=1)
    got = p.rbuf.read(0, 1200 * 512)
    check(all(got[(1199 - i) * 512:(1200 - i) * 512] == src[i * 512:(i + 1) * 512] for i in range(1200)),
          "1200 writes of 512 bytes in one launch: wrong bytes")
    big_n, big = 1200, 64 << 10
    big_buf = p.dev.buffer("ipc", big_n * big)
    big_remote = register(p.owner, big_buf)
    src = fill(p.lbuf, 9)
    many = [(p.local, i % (SIZE // big) * big, big_remote, (big_n - 1 - i) * big, big) for i in range(big_n)]
    calls.since()
    p.write(many)
    expect_calls(calls, "one call of 1200 device writes of 64 KiB", batches=launches([big] * big_n), cuMemcpyAsync=0,
                 cuEventRecord=launches([big] * big_n))
    check(launches([big] * big_n) == 3, "1200 x 64 KiB: three issues expected (at 512 and 1024 copies)")
    got = big_buf.read(0, big_n * big)
    check(all(got[(big_n - 1 - i) * big:(big_n - i) * big] == src[i % (SIZE // big) * big:][:big] for i in range(big_n)),
          "1200 writes of 64 KiB issued in three launches: wrong bytes")
    p.owner.deregister(big_remote)
    src, hsrc = fill(p.lbuf, 2), pattern(3, SIZE)
    p.hbuf.write(0, hsrc)
    ops = [(p.local, 0, p.remote, 0, BLOCK), (p.local, BLOCK, p.remote, BLOCK, BLOCK),
           (p.host, 0, p.remote, 2 * BLOCK, BLOCK),  # host memory: a cuMemcpyAsync of its own
           (p.local, 3 * BLOCK, p.remote, 3 * BLOCK, BLOCK), (p.local, 4 * BLOCK, p.remote, 4 * BLOCK, BLOCK)]
    calls.since()
    p.write(ops)
    expect_calls(calls, "a host op between device ops", batches=2, cuMemcpyAsync=1)
    want = [blk(src, 0), blk(src, 1), blk(hsrc, 0), blk(src, 3), blk(src, 4)]
    check([p.block(p.rbuf, i) for i in range(5)] == want, "a batch split by a host op: wrong bytes")
    p.close()
    print("batched ok", flush=True)


def overlap(args, dev) -> None:
    p = Pair(args, dev)
    calls = Calls(dev)
    src = fill(p.lbuf, 4)
    p.rbuf.write(0, bytes(SIZE))
    # write after write: ops 0 and 2 write remote block 0; op 2's bytes must stay
    p.write([(p.local, 0, p.remote, 0, BLOCK), (p.local, BLOCK, p.remote, BLOCK, BLOCK),
             (p.local, 2 * BLOCK, p.remote, 0, BLOCK), (p.local, 3 * BLOCK, p.remote, 2 * BLOCK, BLOCK)])
    check(p.block(p.rbuf, 0) == blk(src, 2), "write after write in one call: the earlier write won")
    check(p.block(p.rbuf, 1) == blk(src, 1) and p.block(p.rbuf, 2) == blk(src, 3), "write after write: wrong bytes")
    expect_calls(calls, "two runs of two writes", batches=2, cuMemcpyAsync=0, cuEventRecord=1)
    # the same memory registered with both agents: a write's source can be an earlier one's destination
    shared = register(p.owner, p.lbuf)
    x = fill(p.lbuf, 5)
    p.write([(p.local, 0, shared, 4 * BLOCK, BLOCK),            # X4 = X0
             (p.local, 4 * BLOCK, shared, 5 * BLOCK, BLOCK),    # X5 = X4, after the write above: X0
             (p.local, 6 * BLOCK, shared, 7 * BLOCK, BLOCK)])   # X7 = X6
    check(p.block(p.lbuf, 5) == blk(x, 0), "read after write in one call: the later op copied the old bytes")
    check(p.block(p.lbuf, 7) == blk(x, 6), "read after write: wrong bytes in block 7")
    x = fill(p.lbuf, 6)
    p.write([(p.local, 4 * BLOCK, shared, 5 * BLOCK, BLOCK),    # X5 = X4 (the old X4)
             (p.local, 0, shared, 4 * BLOCK, BLOCK)])           # then X4 = X0
    check(p.block(p.lbuf, 5) == blk(x, 4), "write after read in one call: the earlier op read the new bytes")
    check(p.block(p.lbuf, 4) == blk(x, 0), "write after read: wrong bytes in block 4")
    # read after read into the same local bytes: the later read wins
    r = fill(p.rbuf, 7)
    p.lbuf.write(0, bytes(SIZE))
    p.conn.batch_read([(p.local, 0, p.remote, BLOCK, BLOCK), (p.local, 0, p.remote, 3 * BLOCK, BLOCK)]).wait(args.timeout)
    check(p.block(p.lbuf, 0) == blk(r, 3), "two reads into the same bytes in one call: the earlier read won")
    many_with_a_few_overlapping(p)
    p.close()
    print("overlap ok", flush=True)


def many_with_a_few_overlapping(p: Pair, slot: int = 512) -> None:
    """1200 writes to shuffled remote slots, 12 of them writing a slot an earlier one wrote: the
    later wins each time (a call this large finds its overlaps with a radix sort of its ranges,
    transport/byte_ranges.h; the fake's kernel copies last to first, so a missed one shows)."""
    rng = random.Random(11)
    src = fill(p.lbuf, 12)
    p.rbuf.write(0, bytes(SIZE))
    slots = SIZE // slot
    dst = rng.sample(range(slots), 1188)
    for _ in range(12):
        k = rng.randrange(len(dst) // 2)
        dst.insert(rng.randrange(k + 1, len(dst) + 1), dst[k])
    ops = [(p.local, i * slot % SIZE, p.remote, d * slot, slot) for i, d in enumerate(dst)]
    p.write(ops)
    last = {d: i for i, d in enumerate(dst)}
    got = p.rbuf.read(0, SIZE)
    for d, i in last.items():
        at = i * slot % SIZE
        check(got[d * slot:(d + 1) * slot] == src[at:at + slot],
              f"remote slot {d}: not the bytes of op {i}, the last of the call to write it")


def stream(args, dev) -> None:
    p = Pair(args, dev)
    s = dev.stream()
    src = pattern(8, SIZE)
    fill(p.lbuf, 9)
    stage = dev.buffer("ipc", SIZE)
    stage.write(0, src)
    p.rbuf.write(0, bytes(SIZE))
    dev.delay(s, 0.3)
    dev.copy_async(p.lbuf, 0, stage, 0, 16 * BLOCK, s)  # what the batch must copy is put there by the stream
    p.write([(p.local, i * BLOCK, p.remote, (15 - i) * BLOCK, BLOCK) for i in range(16)], stream=s)
    for i in range(16):
        check(p.block(p.rbuf, 15 - i) == blk(src, i), f"a batch on a stream copied block {i} before the stream's work")
    p.close()
    print("stream ok", flush=True)


def off(args, dev) -> None:
    check(os.environ.get("FLAGCX_MESH_CUDA_BATCH_COPY") == "off", "run with FLAGCX_MESH_CUDA_BATCH_COPY=off")
    p = Pair(args, dev)
    calls = Calls(dev)
    reversed_writes(p, 32, 10, "32 writes, batch copies off")
    expect_calls(calls, "batch copies off", cuLaunchKernel=0, cuMemcpyBatchAsync=0, cuMemcpyAsync=32, cuEventRecord=1)
    p.close()
    print("off ok", flush=True)


def mixed(args, dev) -> None:
    p = Pair(args, dev)
    rng = random.Random(13)
    sizes, left = [300 << 10], SIZE - (300 << 10) - 64
    while left > 0:
        n = min(left, rng.choice([1, 3, 15, 16, 17, 4096, 4099, 65536, 65537, rng.randrange(1, 40000)]))
        sizes.append(n)
        left -= n
    rng.shuffle(sizes)
    src_at = [sum(sizes[:i]) + 7 for i in range(len(sizes))]  # unaligned
    order = list(range(len(sizes)))
    rng.shuffle(order)
    dst_at, at = [0] * len(sizes), 33
    for i in order:
        dst_at[i], at = at, at + sizes[i]
    src = fill(p.lbuf, 14)
    p.rbuf.write(0, bytes(SIZE))
    p.write([(p.local, src_at[i], p.remote, dst_at[i], sizes[i]) for i in range(len(sizes))])
    got = p.rbuf.read(0, SIZE)
    for i in range(len(sizes)):
        check(got[dst_at[i]:dst_at[i] + sizes[i]] == src[src_at[i]:src_at[i] + sizes[i]],
              f"mixed sizes: write {i} ({sizes[i]} bytes from {src_at[i]} to {dst_at[i]}) did not land")
    check(got[:33] == bytes(33) and got[at:] == bytes(SIZE - at), "mixed sizes: bytes outside the writes changed")
    p.close()
    print("mixed ok", flush=True)


def no_kernel(args, dev) -> None:
    p = Pair(args, dev)
    calls = Calls(dev)
    reversed_writes(p, 32, 15, "32 writes, no copy kernel")
    expect_calls(calls, "no copy kernel", cuMemcpyBatchAsync=1, cuEventRecord=1)
    reversed_writes(p, 32, 16, "32 more writes")
    expect_calls(calls, "no copy kernel, later", cuLaunchKernel=0, cuMemcpyBatchAsync=1, cuMemcpyAsync=0)
    p.close()
    print("no-kernel ok", flush=True)


def refused(args, dev) -> None:
    check(os.environ.get("FLAGCX_MESH_CUDA_BATCH_COPY") == "driver", "run with FLAGCX_MESH_CUDA_BATCH_COPY=driver")
    p = Pair(args, dev)
    calls = Calls(dev)
    reversed_writes(p, 32, 11, "32 writes, the batch call refused")
    expect_calls(calls, "a refused batch call", cuMemcpyBatchAsync=1, cuMemcpyAsync=32, cuEventRecord=1)
    reversed_writes(p, 32, 12, "32 more writes")
    expect_calls(calls, "after a refused batch call", cuMemcpyBatchAsync=0, cuMemcpyAsync=32)
    p.close()
    print("refused ok", flush=True)


def second_device_buffer(dev, n: int):
    """n zeroed bytes on device 1 (the fake with FXM_FAKECUDA_DEVICES=2, or a second GPU)."""
    if getattr(dev, "cu", None) is not None:
        import fakecuda
        from agent_device_prog import FakeBuf

        cu = fakecuda.FakeCuda(device=1)
        buf = FakeBuf(cu, cu.alloc(n), n)
        buf.write(0, bytes(n))
        return buf
    import torch
    from agent_device_prog import TorchBuf

    check(torch.cuda.device_count() >= 2, "cross-device needs a second GPU")
    return TorchBuf(torch.zeros(n, dtype=torch.uint8, device="cuda:1"))


def cross_device(args, dev) -> None:
    """The user's memory on device 1, the owner's region on device 0, in one process (cuda-self,
    copies on device 0): the copy kernel on device 0 is not given memory of device 1 (no peer
    access was asked for it), so the run goes to the driver's batch call, one for the run, not
    one cuMemcpyAsync per copy; every block lands."""
    p = Pair(args, dev, lbuf=second_device_buffer(dev, SIZE))
    calls = Calls(dev)
    reversed_writes(p, 32, 17, "32 writes from device 1's memory")
    expect_calls(calls, "a run the kernel cannot take", cuLaunchKernel=0, cuMemcpyBatchAsync=1, cuMemcpyAsync=0,
                 cuEventRecord=1)
    p.close()
    print("cross-device ok", flush=True)


def main() -> None:
    roles = {"batched": batched, "mixed": mixed, "overlap": overlap, "stream": stream, "off": off,
             "refused": refused, "no-kernel": no_kernel, "cross-device": cross_device}
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=[*roles, "all"])
    ap.add_argument("--device", choices=["fake", "torch"], default="fake")
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    dev = make_device(args.device)
    for name in (["batched", "mixed", "overlap", "stream"] if args.scenario == "all" else [args.scenario]):
        roles[name](args, dev)


if __name__ == "__main__":
    main()
