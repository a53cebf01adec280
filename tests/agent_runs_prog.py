"""Runs of a write_blocks / read_blocks table (agent/connection.cc: an op naming the same remote
descriptor and local window as the plain device copy before it is only queued after it), two
agents in this process (cuda-self) on the fake CUDA driver, for tests/test_agent_runs_fake.py.
Every scenario fills each buffer with its own bytes, plays the call's ops one after the other on
copies of them (a later op sees what an earlier one wrote), and checks every byte of every buffer
against that after the call.

    switch      rows in stretches of 1 to 300 that change the local region, the remote one or
                both (and size-0 rows inside a stretch), writes then reads: one launch and one
                event (the core issues a call's copies every 32 MiB: agent_batch_prog.launches)
    alternate   the local and the remote region change at every row: one launch, one event
    interrupted stretches of device copies cut by host ops (host region to host region: cma, or
                with FLAGCX_MESH_TRANSPORT=tcp the tcp batch), by an op from host memory to the
                stretch's remote region and by one into a host region (each its own
                cuMemcpyAsync): the copies before each are issued first, as before
    remote-devices (two devices) a stretch to the owner's region on device 1 after one to its
                region on device 0: each issued on its own device's stream, none refused
    devices     (two devices) a stretch from a region on device 1 between ones from device 0,
                to the same remote region: one batch, which the kernel cannot take (one
                cuMemcpyBatchAsync)
    overlap     a write to the bytes an earlier row of the same stretch wrote, and a row reading
                what an earlier one wrote (the same memory registered by both agents): the batch
                is cut there (two launches for each), the later op sees the earlier one's bytes;
                one 600 rows after the row it overwrites, in the run after that row's, lands after it
    hulls       copies within one buffer registered by both agents (what is read lies among
                what is written): disjoint ones in one launch, one overlapping splits it
    refused     a bad row in the middle of a stretch (remote or local range, another agent's
                region, an index naming no region, a negative cell) refuses the call, naming
                that row, and nothing moves; a good call then works
    fallback    (FLAGCX_MESH_CUDA_BATCH_COPY=off, the fake's 31st cuMemcpyAsync refused) the
                driver refuses op 30 of three stretches of 20 (each row its own length): ops
                0-29 land, the 30 left go over staged one by one and land where their rows say
    fallback-fails  (as fallback, the fake's cuMemcpyAsync refused from its 31st call on) staged
                fails too: the call raises, ops 0-29 landed and nothing of the others
Each prints "<scenario> ok" when it passed; any failure exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np

from flagcx_mesh.agent import Agent
from flagcx_mesh.errors import MeshError
from agent_batch_prog import Calls, expect_calls, launches, second_device_buffer
from agent_device_prog import HostBuf, check, make_device, pattern, register

SECRET = "agent-runs-secret"
REGION = 256 << 10
SLOT = 256


class Buffers:
    """Two agents, k device regions on each side, a host region on each, and the model: the
    bytes every buffer must hold, kept by playing each call's ops in order."""

    def __init__(self, args, dev, k: int = 4):
        self.dev, self.timeout = dev, args.timeout
        self.owner = Agent("owner", SECRET, timeout=args.timeout)
        self.user = Agent("user", SECRET, timeout=args.timeout)
        self.rbufs = [dev.buffer("ipc", REGION) for _ in range(k)]
        self.lbufs = [dev.buffer("ipc", REGION) for _ in range(k)]
        self.rhost, self.lhost = HostBuf(REGION), HostBuf(REGION)
        self.remotes = [register(self.owner, b) for b in self.rbufs] + [register(self.owner, self.rhost)]
        self.locals = [register(self.user, b) for b in self.lbufs] + [register(self.user, self.lhost)]
        self.rmem = self.rbufs + [self.rhost]  # the buffer of each remote / local index
        self.lmem = self.lbufs + [self.lhost]
        self.conn = self.user.connect(self.owner.metadata())
        path = self.conn.path_to(self.remotes[0], self.locals[0])
        check(path == "cuda-self", f"the path is {path}, expected cuda-self")
        self.model = {}
        self.fill(1)

    def close(self):
        self.user.close()
        self.owner.close()

    def with_remote(self, buf):
        """(remotes, rmem) with `buf` registered by the owner as one more remote region (index 5)."""
        return self.remotes + [register(self.owner, buf)], self.rmem + [buf]

    def step(self, calls, what: str, t, counts: dict, **call) -> None:
        """One call of table t (call: call()'s keywords), every byte checked against the rows played
        in order, and the driver calls it made (counts: expect_calls' keywords)."""
        self.call(t, **call)
        self.verify(what)
        expect_calls(calls, what, **counts)

    def fill(self, seed: int) -> None:
        for i, b in enumerate(self.rmem + self.lmem):
            data = pattern(seed * 100 + i, REGION)
            b.write(0, data)
            self.model[id(b)] = bytearray(data)

    def play(self, table, is_read: bool, rmem=None, lmem=None) -> None:
        """The rows' effect on the model, one after the other."""
        rmem, lmem = rmem or self.rmem, lmem or self.lmem
        for li, lo, ri, ro, n in table.tolist():
            (dst, d), (src, s) = ((lmem[li], lo), (rmem[ri], ro)) if is_read else ((rmem[ri], ro), (lmem[li], lo))
            self.model[id(dst)][d:d + n] = bytes(self.model[id(src)][s:s + n])

    def verify(self, what: str, settle: bool = False) -> None:
        """settle: copies may still be under way (a call that failed has no handle to wait on)."""
        deadline = time.monotonic() + (self.timeout if settle else 0)
        for i, b in enumerate(self.rmem + self.lmem):
            want = bytes(self.model[id(b)])
            got = b.read(0, REGION)
            while got != want and time.monotonic() < deadline:
                time.sleep(0.05)
                got = b.read(0, REGION)
            if got != want:
                at = next(j for j in range(REGION) if got[j] != want[j])
                check(False, f"{what}: buffer {i} differs from the ops played in order, first at byte {at}")

    def call(self, table, is_read: bool = False, remotes=None, rmem=None, locals_=None, lmem=None) -> None:
        """One write_blocks (read_blocks) of the table, waited for, and played on the model;
        remotes / rmem, locals_ / lmem: other regions and their buffers."""
        f = self.conn.read_blocks if is_read else self.conn.write_blocks
        f(locals_ or self.locals, remotes or self.remotes, table).wait(self.timeout)
        self.play(table, is_read, rmem=rmem, lmem=lmem)


def table(rows) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def slots(rng: random.Random, n: int) -> list:
    return rng.sample(range(REGION // SLOT), n)


def stretches(rng: random.Random, n: int, k: int, size: int = 64) -> np.ndarray:
    """n rows in stretches of 1 to 300 rows of one (local, remote) pair each; each stretch
    changes the local region, the remote one or both; every destination slot distinct."""
    free = {r: slots(rng, REGION // SLOT) for r in range(k)}
    rows, li, ri = [], 0, 0
    while len(rows) < n:
        change = rng.choice(["local", "remote", "both"])
        if change in ("local", "both"):
            li = (li + rng.randrange(1, k)) % k
        if change in ("remote", "both"):
            ri = (ri + rng.randrange(1, k)) % k
        for _ in range(min(n - len(rows), rng.choice([1, 2, 3, 17, 100, 300]))):
            n_bytes = 0 if rng.random() < 0.02 else size
            rows.append((li, rng.randrange(REGION // SLOT) * SLOT, ri, free[ri].pop() * SLOT, n_bytes))
    return table(rows)


def switch(args, dev) -> None:
    b = Buffers(args, dev)
    calls = Calls(dev)
    rng = random.Random(21)
    t = stretches(rng, 2000, 4)
    n = launches(t[:, 4])
    b.step(calls, "writes in stretches", t, dict(batches=n, cuMemcpyAsync=0, cuEventRecord=n))
    b.fill(2)
    t = stretches(rng, 2000, 4, size=200)
    t[:, [0, 2]] = t[:, [2, 0]]  # reads: the distinct slots are the local ones now
    t[:, [1, 3]] = t[:, [3, 1]]
    n = launches(t[:, 4])
    b.step(calls, "reads in stretches", t, dict(batches=n, cuMemcpyAsync=0, cuEventRecord=n), is_read=True)
    b.close()
    print("switch ok", flush=True)


def alternate(args, dev) -> None:
    b = Buffers(args, dev)
    calls = Calls(dev)
    n, dst = 1000, slots(random.Random(22), 1000)
    t = table([(i % 4, i * SLOT, (i * 3) % 4, dst[i] * SLOT, 1 + i % SLOT) for i in range(n)])
    b.step(calls, "a region change at every row", t, dict(batches=launches(t[:, 4]), cuMemcpyAsync=0,
                                                           cuEventRecord=launches(t[:, 4])))
    b.close()
    print("alternate ok", flush=True)


def interrupted(args, dev) -> None:
    b = Buffers(args, dev)
    calls = Calls(dev)
    h = 4  # the host region's index on each side
    rng = random.Random(23)
    dst = {r: slots(rng, 400) for r in range(5)}
    rows = []

    def run(li, ri, n):
        rows.extend((li, rng.randrange(REGION // SLOT) * SLOT, ri, dst[ri].pop() * SLOT, 128) for _ in range(n))

    run(0, 0, 50)
    rows.append((h, 0, h, dst[h].pop() * SLOT, 128))  # host to host: cma (or the tcp batch)
    rows.append((h, SLOT, h, dst[h].pop() * SLOT, 128))
    run(0, 0, 50)  # the same pair as before the host ops
    rows.append((h, 2 * SLOT, 0, dst[0].pop() * SLOT, 128))  # from host memory to the same region: a cuMemcpyAsync
    run(0, 0, 30)
    rows.append((1, 3 * SLOT, h, dst[h].pop() * SLOT, 128))  # into a host region: a cuMemcpyAsync
    run(1, 0, 30)
    run(1, 2, 30)
    # each host op issues the copies before it: 4 batches, and one copy each for the two device
    # ops with a host end (events: one a batch, one each for those two)
    b.step(calls, "stretches cut by host ops", table(rows), dict(batches=4, cuMemcpyAsync=2, cuEventRecord=6))
    b.close()
    print("interrupted ok", flush=True)


def devices(args, dev) -> None:
    """(two devices) A local region on device 1 between stretches from device 0 to the same
    remote region: its copies go in the same batch, which the kernel on device 0 cannot take
    (one cuMemcpyBatchAsync for it all)."""
    b = Buffers(args, dev)
    other = second_device_buffer(dev, REGION)
    other.write(0, pattern(9, REGION))
    b.model[id(other)] = bytearray(pattern(9, REGION))
    locals_, lmem = b.locals + [register(b.user, other)], b.lmem + [other]
    b.conn.path_to(b.remotes[0], locals_[5])  # its path set up (the copy kernel's first launch) before the count
    calls = Calls(dev)
    rng = random.Random(28)
    dst = slots(rng, 300)  # (rows 100-199 from device 1)
    rows = [(5 if 100 <= i < 200 else 0, rng.randrange(REGION // SLOT) * SLOT, 0, dst[i] * SLOT, 64) for i in range(300)]
    b.step(calls, "stretches from two devices", table(rows),
           dict(cuLaunchKernel=0, cuMemcpyBatchAsync=1, cuMemcpyAsync=0, cuEventRecord=1), locals_=locals_, lmem=lmem)
    check(other.read(0, REGION) == bytes(b.model[id(other)]), "stretches from two devices: device 1's region changed")
    b.close()
    print("devices ok", flush=True)


def remote_devices(args, dev) -> None:
    """(two devices) A stretch to the owner's region on device 1 after one to its region on
    device 0 (cuda-self copies on the remote region's device): the first stretch's copies are
    issued on device 0's stream before device 1's is made. Before, making device 1's stream
    destroyed device 0's, on which the first stretch's copies were then issued: the driver
    refused them (an invalid handle) and they went over staged."""
    b = Buffers(args, dev)
    other = second_device_buffer(dev, REGION)
    other.write(0, pattern(11, REGION))
    b.model[id(other)] = bytearray(pattern(11, REGION))
    remotes, rmem = b.with_remote(other)
    b.conn.path_to(remotes[5], b.locals[0])  # its path set up (the copy kernel's first launch) before the count
    calls = Calls(dev)
    rng = random.Random(29)
    dst = slots(rng, 200)
    rows = [(0, rng.randrange(REGION // SLOT) * SLOT, 0 if i < 100 else 5, dst[i] * SLOT, 64) for i in range(200)]
    b.step(calls, "stretches to two devices", table(rows), dict(cuMemcpyAsync=0, cuEventRecord=2),
           remotes=remotes, rmem=rmem)
    check(other.read(0, REGION) == bytes(b.model[id(other)]), "stretches to two devices: device 1's region differs")
    b.close()
    print("remote-devices ok", flush=True)


def overlap(args, dev) -> None:
    b = Buffers(args, dev)
    calls = Calls(dev)
    rng = random.Random(24)
    dst = slots(rng, 1000)
    rows = [(0, rng.randrange(REGION // SLOT) * SLOT, 1, dst[i] * SLOT, 96) for i in range(1000)]
    rows[300] = (0, 5 * SLOT, 1, rows[100][3], 96)  # writes what row 100 wrote
    rows[900] = (0, 6 * SLOT, 1, rows[200][3], 96)  # and what row 200 wrote, in the run before its own: after it
    b.step(calls, "a write after a write in one stretch", table(rows),
           dict(batches=2, cuMemcpyAsync=0, cuEventRecord=1))  # one issue (96 KiB), cut at 300
    # the user's region 2 registered by the owner too: remote index 5 is local region 2's memory
    remotes, rmem = b.with_remote(b.lbufs[2])
    dst = slots(rng, 601)
    rows = [(2, dst[i] * SLOT, 5, dst[300 + i] * SLOT, SLOT) for i in range(300)]  # local 2 to itself
    rows[200] = (2, rows[50][3], 5, dst[600] * SLOT, SLOT)  # reads what row 50 wrote
    b.step(calls, "a read after a write in one stretch", table(rows), dict(batches=2, cuMemcpyAsync=0, cuEventRecord=1),
           remotes=remotes, rmem=rmem)
    b.close()
    print("overlap ok", flush=True)


def hulls(args, dev) -> None:
    b = Buffers(args, dev)
    calls = Calls(dev)
    remotes, rmem = b.with_remote(b.lbufs[0])
    n = 500  # (1000 spans, past 512: the radix sort)
    order = slots(random.Random(25), 2 * n)
    rows = [(0, order[2 * i] * SLOT, 5, order[2 * i + 1] * SLOT, 100) for i in range(n)]  # read and written slots interleave
    b.step(calls, "copies within one buffer", table(rows), dict(batches=1, cuMemcpyAsync=0, cuEventRecord=1),
           remotes=remotes, rmem=rmem)
    b.fill(3)
    rows[400] = (0, rows[200][3] + 50, 5, rows[400][3], 100)  # reads bytes row 200 wrote
    b.step(calls, "copies within one buffer, one reading an earlier one's", table(rows),
           dict(batches=2, cuMemcpyAsync=0, cuEventRecord=1), remotes=remotes, rmem=rmem)
    b.close()
    print("hulls ok", flush=True)


def refused(args, dev) -> None:
    b = Buffers(args, dev)
    calls = Calls(dev)
    rng = random.Random(26)
    good = stretches(rng, 500, 4)
    good[:, 4] = 64
    other = Agent("other", SECRET, timeout=args.timeout)
    foreign = register(other, dev.buffer("ipc", REGION))

    def refuse(t, want: str, remotes=None) -> None:
        try:
            b.conn.write_blocks(b.locals, remotes or b.remotes, t).wait(b.timeout)
        except MeshError as e:
            check(want in str(e), f"refused for {e}, expected the words {want!r}")
        else:
            check(False, f"a table with a bad row was not refused ({want})")
        b.verify(f"refused ({want}): nothing may move")
        expect_calls(calls, f"refused ({want})", cuLaunchKernel=0, cuMemcpyBatchAsync=0, cuMemcpyAsync=0)

    li, lo, ri, ro = good[250, :4].tolist()
    t = good.copy()
    t[250, 3] = REGION - 32
    refuse(t, f"write op 250 of 64 bytes at remote [{REGION - 32}, {REGION - 32}+64): out of range of its region "
              f"#{b.remotes[ri].index} ({REGION} bytes)")
    t = good.copy()
    t[300, 1] = REGION
    refuse(t, f"write op 300 of 64 bytes at local [{REGION}, {REGION}+64): out of range of local region "
              f"#{b.locals[t[300, 0]].index} ({REGION} bytes)")
    t = good.copy()
    t[260, 2] = 5  # the other agent's region
    refuse(t, "write op 260 of 64 bytes to a region of agent other, not of this connection's peer",
           remotes=b.remotes + [foreign])
    t = good.copy()
    t[270, 2] = 9
    refuse(t, "op 270: remote index 9 names no region (5 given)")
    t = good.copy()
    t[280, 3] = -SLOT
    refuse(t, f"op 280: remote offset is negative ({-SLOT})")
    b.call(good)
    b.verify("a good call after refused ones")
    other.close()
    b.close()
    print("refused ok", flush=True)


def three_stretches(size_of) -> np.ndarray:
    """Three stretches of 20 rows (local 0 to remote 0, local 1 to remote 1, local 0 to remote 2),
    row i of size_of(i) bytes, to slots of their own."""
    rng = random.Random(27)
    rows = []
    for li, ri in ((0, 0), (1, 1), (0, 2)):
        for s in slots(rng, 20):
            rows.append((li, rng.randrange(REGION // SLOT) * SLOT, ri, s * SLOT, size_of(len(rows))))
    return table(rows)


def fallback(args, dev) -> None:
    """The driver refuses op 30's copy alone (the 31st cuMemcpyAsync): ops 0-29 land by the
    driver, op 30 and the 29 after it go over staged one by one (each rebuilt from its run's
    first op with its own offsets and length), and every byte is where the ops put it."""
    check(os.environ.get("FLAGCX_MESH_CUDA_BATCH_COPY") == "off", "run with FLAGCX_MESH_CUDA_BATCH_COPY=off")
    b = Buffers(args, dev)
    b.call(three_stretches(lambda i: 64 + 3 * i))  # (sizes 64 to 241 bytes: within a slot)
    b.verify("a refusal at op 30, the rest over staged")
    b.close()
    print("fallback ok", flush=True)


def fallback_fails(args, dev) -> None:
    """The driver refuses every copy from op 30's on (the fake's cuMemcpyAsync from its 31st
    call): ops 0-29 land, the 30 left go to staged, which fails too: the call raises, and none of
    their bytes lands."""
    check(os.environ.get("FLAGCX_MESH_CUDA_BATCH_COPY") == "off", "run with FLAGCX_MESH_CUDA_BATCH_COPY=off")
    b = Buffers(args, dev)
    t = three_stretches(lambda i: 64)
    try:
        b.conn.write_blocks(b.locals, b.remotes, t).wait(b.timeout)
    except MeshError as e:
        print(f"the call failed: {e}", flush=True)
    else:
        check(False, "the driver refused the copies and staged: the call did not fail")
    b.play(t[:30], False)  # the driver did the first 30 copies, none of the others landed
    b.verify("a refusal at op 30, staged refused too", settle=True)
    b.close()
    print("fallback-fails ok", flush=True)


def main() -> None:
    roles = {"switch": switch, "alternate": alternate, "interrupted": interrupted, "devices": devices,
             "remote-devices": remote_devices, "overlap": overlap, "hulls": hulls, "refused": refused,
             "fallback": fallback, "fallback-fails": fallback_fails}
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=list(roles))
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    roles[args.scenario](args, make_device("fake"))


if __name__ == "__main__":
    main()
