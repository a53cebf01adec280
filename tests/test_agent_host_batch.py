"""One agent call of many ops on host memory, over cma (one process_vm_writev / readv per up to
IOV_MAX ops, transport/cma/iov_batch.h) and over tcp (forced): batches of 1 to 100,000 ops of
mixed sizes land every byte (checked against one contiguous read back), ops of one call that
touch the same bytes keep their order (the later wins), an op that crosses its region's end is
refused naming it with nothing written, and a peer killed while batches are in flight fails
them (PeerLost), never a hang. The target is a process of tests/agent_host_prog.py."""

from __future__ import annotations

import os
import random
import signal
import threading

import numpy as np
import pytest

from flagcx_mesh import InvalidArgument, PeerLost
from flagcx_mesh.agent import Agent
from meshutil import finish_prog, spawn_prog, wait_file

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "agent_host_prog.py")
SECRET = "agent-host-batch-secret"
SIZE = 16 << 20

pytestmark = pytest.mark.timeout(240)

TRANSPORTS = ["cma", "tcp"]


class Pair:
    """This process's agent, connected to a target process holding a zeroed SIZE-byte region."""

    def __init__(self, tmp_path, transport, monkeypatch):
        monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", transport)
        self.target = spawn_prog(PROG, "target", tmp_path, SIZE, env=dict(os.environ), merge=True)
        self.agent = Agent("initiator", SECRET, timeout=60)
        self.conn = self.agent.connect(wait_file(tmp_path / "target.meta"))
        self.remote = wait_file(tmp_path / "target.region")
        self.src = np.zeros(SIZE, dtype=np.uint8)
        self.back = np.zeros(SIZE, dtype=np.uint8)
        self.local = self.agent.register(self.src)
        self.local_back = self.agent.register(self.back)
        path = self.conn.path_to(self.remote)
        assert path == transport, f"the path is {path}, not {transport}"

    def remote_bytes(self) -> np.ndarray:
        """The target's region, read back whole in one op."""
        self.back[:] = 0
        self.conn.read(self.local_back, self.remote, SIZE).wait(60)
        return self.back.copy()

    def close(self, killed=False):
        if not killed:
            self.conn.notify(b"bye")
        self.agent.close()
        if killed:
            self.target.communicate(timeout=30)
        else:
            finish_prog(self.target, ok="target ok")


@pytest.fixture(params=TRANSPORTS)
def pair(request, tmp_path, monkeypatch):
    p = Pair(tmp_path, request.param, monkeypatch)
    yield p
    p.close(killed=p.target.poll() is not None)


def scattered(n: int, rng: random.Random, small: int, large: int = 0):
    """n ops of sizes 1..small (every 997th: `large` bytes) laid out without gaps on both sides,
    in two independent shuffled orders: (local_off, remote_off, size) per op."""
    sizes = [large if large and i % 997 == 0 else rng.randint(1, small) for i in range(n)]
    assert sum(sizes) <= SIZE
    def places(order):
        at, off = 0, [0] * n
        for i in order:
            off[i] = at
            at += sizes[i]
        return off
    lo, ro = list(range(n)), list(range(n))
    rng.shuffle(lo)
    rng.shuffle(ro)
    return list(zip(places(lo), places(ro), sizes))


@pytest.mark.parametrize("n,small,large", [(1, 4096, 0), (2, 64, 0), (1023, 4096, 0), (1025, 4096, 0),
                                           (600, 32768, 0), (100_000, 96, 1 << 16)])
def test_a_batch_of_mixed_sizes_lands_every_byte(pair, n, small, large):
    rng = random.Random(n)
    ops = scattered(n, rng, small, large)
    pair.src[:] = np.frombuffer(rng.randbytes(SIZE), dtype=np.uint8)
    want = np.zeros(SIZE, dtype=np.uint8)
    for lo, ro, sz in ops:
        want[ro:ro + sz] = pair.src[lo:lo + sz]
    pair.conn.batch_write([(pair.local, lo, pair.remote, ro, sz) for lo, ro, sz in ops]).wait(120)
    got = pair.remote_bytes()
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} bytes wrong after a batch write of {n} ops, the first at {bad[0]}"
    # and back: the same ops read into a cleared buffer
    pair.src[:] = 0
    pair.conn.batch_read([(pair.local, lo, pair.remote, ro, sz) for lo, ro, sz in ops]).wait(120)
    for lo, ro, sz in ops:
        assert np.array_equal(pair.src[lo:lo + sz], want[ro:ro + sz]), f"batch read of {n} ops: op at {lo} wrong"


def test_ops_of_one_call_over_the_same_bytes_keep_their_order(pair):
    block = 4096
    pair.src[:8 * block] = np.repeat(np.arange(1, 9, dtype=np.uint8), block)
    # writes: remote block 0 written by ops 0, 2 and 5; block 1 by ops 1 and 4 (the last wins),
    # and a write straddling blocks 2-3 after two that fill them
    ops = [(0, 0, block), (block, block, block), (2 * block, 0, block), (3 * block, 2 * block, 2 * block),
           (4 * block, block, block), (5 * block, 0, block), (6 * block, 2 * block + 100, block)]
    pair.conn.batch_write([(pair.local, lo, pair.remote, ro, sz) for lo, ro, sz in ops]).wait(60)
    want = np.zeros(SIZE, dtype=np.uint8)
    for lo, ro, sz in ops:
        want[ro:ro + sz] = pair.src[lo:lo + sz]
    got = pair.remote_bytes()
    assert np.array_equal(got[:8 * block], want[:8 * block]), "a later write of one call did not win"
    assert got[0] == 6 and got[block] == 5 and got[2 * block + 100] == 7
    # reads into the same local bytes: the later wins
    pair.src[:] = 0
    reads = [(0, 0, block), (0, block, block), (block, 0, 2 * block), (block + 10, 2 * block + 100, 50)]
    pair.conn.batch_read([(pair.local, lo, pair.remote, ro, sz) for lo, ro, sz in reads]).wait(60)
    local = np.zeros(SIZE, dtype=np.uint8)
    for lo, ro, sz in reads:
        local[lo:lo + sz] = got[ro:ro + sz]
    assert np.array_equal(pair.src[:4 * block], local[:4 * block]), "a later read of one call did not win"


@pytest.mark.parametrize("n", [600, 3000])
def test_a_large_batch_keeps_the_order_of_the_few_ops_over_the_same_bytes(pair, n):
    """Thousands of disjoint writes with a few that rewrite an earlier one's bytes (whole, or in
    part) at random places among them: each later write wins. Batches this large find their
    overlaps with a radix sort of the ops' ranges (transport/byte_ranges.h), small ones with a
    comparison sort."""
    rng = random.Random(n)
    ops = scattered(n, rng, 2048)
    for _ in range(8):  # a later op over (part of) an earlier one's remote bytes
        i = rng.randrange(n // 2)
        lo, ro, sz = ops[i]
        cut = rng.randrange(sz)
        ops.insert(rng.randrange(i + 1, len(ops) + 1), (rng.randrange(SIZE - sz), ro + cut, sz - cut))
    pair.src[:] = np.frombuffer(rng.randbytes(SIZE), dtype=np.uint8)
    want = np.zeros(SIZE, dtype=np.uint8)
    for lo, ro, sz in ops:
        want[ro:ro + sz] = pair.src[lo:lo + sz]
    pair.conn.batch_write([(pair.local, lo, pair.remote, ro, sz) for lo, ro, sz in ops]).wait(120)
    bad = np.flatnonzero(pair.remote_bytes() != want)
    assert bad.size == 0, f"{bad.size} bytes wrong, the first at {bad[0]}: a later write of the batch did not win"


def test_an_op_crossing_its_region_end_is_refused_naming_it_and_nothing_is_written(pair):
    pair.src[:] = 9
    ops = [(pair.local, i * 64, pair.remote, i * 64, 64) for i in range(2000)]
    ops[1234] = (pair.local, 0, pair.remote, SIZE - 100, 4096)
    with pytest.raises(InvalidArgument, match=r"op 1234 .*out of range"):
        pair.conn.batch_write(ops)
    ops[1234] = (pair.local, SIZE - 10, pair.remote, 0, 64)  # the local end, read side
    with pytest.raises(InvalidArgument, match=r"op 1234 .*out of range"):
        pair.conn.batch_read(ops)
    assert not pair.remote_bytes().any(), "a refused batch wrote bytes"


def test_a_peer_killed_mid_batch_fails_the_batch_without_a_hang(pair):
    ops = [(pair.local, i * 128, pair.remote, ((i * 7919) % (SIZE // 128)) * 128, 128) for i in range(50_000)]
    started, outcome = threading.Event(), []

    def writer():
        try:
            for _ in range(100_000):  # until the loss is seen, by a call or its handle
                pair.conn.batch_write(ops).wait(60)
                started.set()
        except PeerLost as e:
            outcome.append(e)
        except Exception as e:  # anything else fails the test
            outcome.append(e)
        finally:
            started.set()

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    assert started.wait(120)
    pair.target.send_signal(signal.SIGKILL)
    pair.target.wait(30)
    t.join(180)
    assert not t.is_alive(), "the batches did not end after the peer was killed"
    assert outcome and isinstance(outcome[0], PeerLost), f"expected PeerLost, got {outcome!r}"
    assert "target" in str(outcome[0])


@pytest.mark.parametrize("batch", ["auto", "off", "bogus"])
def test_small_tcp_writes_of_one_call_are_one_frame_refused_whole_at_the_target(monkeypatch, batch):
    """Over tcp, a call's small writes between host memories are one kPutBlocks frame
    (transport/tcp/block_batch.h): the target checks every block before any byte lands, so a
    block into a region it deregistered refuses the frame whole, naming that block, and none
    of the others lands. FLAGCX_MESH_TCP_BATCH=off sends each op alone: only that op fails;
    another value is taken as auto (warned once)."""
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    monkeypatch.setenv("FLAGCX_MESH_TCP_BATCH", batch)
    with Agent("tcp-blocks-target", SECRET, timeout=30) as target, Agent("tcp-blocks-init", SECRET, timeout=30) as me:
        a, b, src = np.zeros(1 << 16, np.uint8), np.zeros(1 << 16, np.uint8), np.full(1 << 16, 7, np.uint8)
        ra, rb, local = target.register(a), target.register(b), me.register(src)
        conn = me.connect(target.metadata())
        assert conn.path_to(ra.descriptor) == "tcp"
        conn.write(local, rb.descriptor, 8).wait(30)  # the path to b is made while it is registered
        target.deregister(rb)
        ops = [(local, 0, ra.descriptor, i * 1024, 1024) for i in range(10)]
        ops[3] = (local, 0, rb.descriptor, 0, 1024)
        with pytest.raises(InvalidArgument) as info:
            conn.batch_write(ops).wait(30)
        msg = str(info.value)
        if batch != "off":
            assert "block 3 of a batch of 10 writes (1024 bytes to window #" in msg and "deregistered" in msg, msg
            assert not a.any(), "a block of a refused batch landed"
        else:
            assert "deregistered" in msg and "batch" not in msg, msg
            assert a[:3 * 1024].all() and a[4 * 1024:10 * 1024].all(), "the other ops did not land"
        conn.batch_write([(local, 0, ra.descriptor, i * 1024, 1024) for i in range(10)]).wait(30)
        assert a[:10 * 1024].all(), "a batch after the refused one did not land"
