"""A call's small tcp writes between host memories are one kPutBlocks frame (tcp/block_batch.h);
one of 1 MiB or more is striped over the connection's tcp lanes (wire::kBlocksStriped): lane 0
carries the list and the first part of the blocks' bytes, each other lane a kStripe of the
rest. These tests check that such a batch travels over every lane, lands every byte wherever
its blocks and the part boundaries fall, keeps its place among the connection's other ops
(a later write over its bytes wins, and it wins over an earlier one), is refused whole when a
block names a region the target deregistered (no part lands, on any lane), and fails with
PeerLost, never a hang, when a lane dies under it."""

from __future__ import annotations

import os
import random
import struct
import time

import numpy as np
import pytest

from flagcx_mesh import InvalidArgument
from flagcx_mesh.agent import Agent
import agent_handshake as hs
from meshutil import acked_since, bytes_acked, fail_with_peer_lost, lane_sockets, shut_lane

pytestmark = pytest.mark.timeout(120)
SECRET = "lanes-blocks-secret"
MIB = 1 << 20
OP_TIMEOUT = 30.0


def make_agent(monkeypatch, name, lanes):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    monkeypatch.setenv("FLAGCX_MESH_TCP_LANES", str(lanes))
    return Agent(name, SECRET, timeout=OP_TIMEOUT)


def pattern(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def blocks(rng, n, size, region_bytes):
    """n blocks of `size` bytes (an int, or a (lo, hi) range of sizes), at shuffled places
    without overlap on each side: (local offset, remote offset, length) each."""
    sizes = [size if isinstance(size, int) else rng.randint(*size) for _ in range(n)]
    assert sum(sizes) <= region_bytes

    def places():
        order, at, off = list(range(n)), 0, [0] * n
        rng.shuffle(order)
        for i in order:
            off[i] = at
            at += sizes[i]
        return off

    return list(zip(places(), places(), sizes))


class Pair:
    """b holds two zeroed regions of `region` bytes; a writes to them from two of its own."""

    def __init__(self, monkeypatch, lanes, region=8 * MIB):
        self.b = make_agent(monkeypatch, "b", lanes)
        self.a = make_agent(monkeypatch, "a", lanes)
        self.dst = [np.zeros(region, np.uint8) for _ in range(2)]
        self.remote = [self.b.register(d) for d in self.dst]
        self.src = [pattern(region, 10 + k) for k in range(2)]
        self.local = [self.a.register(s) for s in self.src]
        self.conn = self.a.connect(self.b.metadata())
        assert self.conn.tcp_lanes == lanes and self.conn.path_to(self.remote[0]) == "tcp"
        self.region = region

    def ops(self, placed, side=lambda i: i % 2):
        """Ops alternating the regions on both sides (op i: local region side(i), remote 1 - side(i))."""
        return [(self.local[side(i)], lo, self.remote[1 - side(i)], ro, n) for i, (lo, ro, n) in enumerate(placed)]

    def model(self, ops, want=None):
        """Both remote regions after `ops`, played in order on copies (or on `want`)."""
        want = want if want is not None else [np.zeros(self.region, np.uint8) for _ in range(2)]
        for local, lo, remote, ro, n in ops:
            want[self.remote.index(remote)][ro:ro + n] = self.src[self.local.index(local)][lo:lo + n]
        return want

    def check(self, want, what):
        for k in range(2):
            bad = np.flatnonzero(self.dst[k] != want[k])
            assert bad.size == 0, f"{what}: {bad.size} bytes of region {k} wrong, the first at {bad[0]}"

    def close(self):
        self.a.close()
        self.b.close()


@pytest.fixture
def pair4(monkeypatch):
    p = Pair(monkeypatch, 4)
    yield p
    p.close()


def test_a_batch_of_1_mib_or_more_travels_over_every_lane_and_lands_before_its_notification(pair4):
    p = pair4
    placed = blocks(random.Random(1), 512, 16 << 10, p.region)  # 8 MiB in 16 KiB blocks
    socks = lane_sockets(p.b.address)
    assert len(socks) == 4
    before = [bytes_acked(s) for s in socks]
    ops = p.ops(placed)
    h = p.conn.batch_write(ops, notification=b"kv")
    got = p.b.notifications(timeout=OP_TIMEOUT)  # first: every byte is there when it arrives
    assert [n.data for n in got] == [b"kv"], got
    p.check(p.model(ops), "a striped batch, when its notification arrived")
    h.wait(OP_TIMEOUT)
    total = sum(n for _, _, n in placed)
    sent = acked_since(socks, before, total // 4)
    for s in socks:
        s.close()
    # lane 0 carries the list (24 bytes a block) beside its quarter; each lane its quarter
    assert all(total // 4 <= n <= total // 4 + 512 * 24 + 4096 for n in sent), sent


@pytest.mark.parametrize("lanes", [2, 3, 4, 8])
@pytest.mark.parametrize("n,size", [(700, (1, 6000)), (64, (40_000, 70_000)), (5000, (100, 1000)),
                                    (8, (200_000, 262_144))])
def test_striped_batches_land_every_byte_wherever_the_parts_cut_the_blocks(monkeypatch, lanes, n, size):
    """Totals that the lanes do not divide, blocks of odd sizes that straddle the parts' ends,
    at 8 lanes blocks (up to 256 KiB, the largest a batch takes) that span parts: every byte
    lands where its op says."""
    p = Pair(monkeypatch, lanes)
    try:
        rng = random.Random(n * 10 + lanes)
        placed = blocks(rng, n, size, p.region)
        if sum(b[2] for b in placed) < MIB:  # at least 1 MiB: striped
            placed = blocks(rng, n, MIB // n + 1, p.region)
        ops = p.ops(placed, side=lambda i: (i // 3) % 2)
        p.conn.batch_write(ops).wait(OP_TIMEOUT)
        p.check(p.model(ops), f"a batch of {n} writes over {lanes} lanes")
    finally:
        p.close()


def test_a_striped_batch_keeps_its_place_among_the_connections_ops(pair4):
    """Each op over bytes an earlier one wrote wins, whether the earlier or the later one is a
    striped batch, a small write or a striped put; issued without waiting in between."""
    p = pair4
    rng = random.Random(7)
    first = p.ops(blocks(rng, 300, (3000, 9000), p.region))
    over = [(p.local[0], 100, p.remote[1 - i % 2], first[i][3] + 5, 64) for i in range(0, 300, 37)]
    big = [(p.local[1], 0, p.remote[0], 0, 3 * MIB + 3)]  # one striped put over part of region 0
    second = p.ops(blocks(rng, 200, (5000, 12000), p.region), side=lambda i: 1 - i % 2)
    handles = [p.conn.batch_write(first), p.conn.batch_write(over), p.conn.write(p.local[1], p.remote[0], 3 * MIB + 3),
               p.conn.batch_write(second)]
    for h in handles:
        h.wait(OP_TIMEOUT)
    p.check(p.model(first + over + big + second), "ops around striped batches")


def test_a_batch_whose_blocks_land_on_each_others_bytes_keeps_to_lane_0_and_the_later_wins(pair4):
    """Striped parts land at once, so a batch of 1 MiB or more whose blocks land on each other's
    bytes is not striped: the block at the end of what would be lane 0's part and the one at the
    start of lane 3's write the same bytes, and the later one must win, every time."""
    p = pair4
    socks = lane_sockets(p.b.address)
    before = [bytes_acked(s) for s in socks]
    block = 32 << 10
    for round_ in range(5):
        ops = [(p.local[round_ % 2], k * block, p.remote[0], k * block, block) for k in range(64)]  # 2 MiB
        ops[48] = (p.local[1 - round_ % 2], 7 * block, p.remote[0], 15 * block, block)  # over block 15's bytes
        p.conn.batch_write(ops).wait(OP_TIMEOUT)
        p.check(p.model(ops), f"round {round_}: a batch with a later block over an earlier one's bytes")
    sent = sorted(bytes_acked(s) - b for s, b in zip(socks, before))  # (the sockets come in fd order)
    for s in socks:
        s.close()
    assert max(sent[:-1]) < 64 << 10 and sent[-1] >= 10 * MIB, f"not kept to one lane: {sent}"


def test_a_striped_batch_naming_a_deregistered_region_is_refused_whole_on_every_lane(pair4):
    p = pair4
    extra = np.zeros(MIB, np.uint8)
    r_extra = p.b.register(extra)
    p.conn.write(p.local[0], r_extra, 8).wait(OP_TIMEOUT)  # the path to it is made while it is registered
    p.dst[0][:8] = 0
    extra[:8] = 0
    p.b.deregister(r_extra)
    placed = blocks(random.Random(3), 400, 16 << 10, p.region)
    ops = p.ops(placed)
    ops[250] = (p.local[0], 0, r_extra, 0, 4096)
    with pytest.raises(InvalidArgument) as info:
        p.conn.batch_write(ops).wait(OP_TIMEOUT)
    msg = str(info.value)
    assert "block 250 of a batch of 400 writes" in msg and "deregistered" in msg, msg
    assert not p.dst[0].any() and not p.dst[1].any(), "a part of a refused striped batch landed"
    ops = p.ops(placed)
    p.conn.batch_write(ops).wait(OP_TIMEOUT)  # the next batch lands whole
    p.check(p.model(ops), "the batch after a refused one")


@pytest.mark.parametrize("lane", [0, 2])
def test_a_lane_killed_under_striped_batches_fails_them_with_peer_lost(monkeypatch, lane):
    p = Pair(monkeypatch, 4, region=32 * MIB)
    try:
        ops = p.ops(blocks(random.Random(5), 2048, 16 << 10, p.region))
        socks = lane_sockets(p.b.address)
        handles = [p.conn.batch_write(ops) for _ in range(6)]
        shut_lane(socks, lane)
        fail_with_peer_lost(handles, "agent b", OP_TIMEOUT)
    finally:
        p.close()


# ---- a peer's frames, written by hand: what the target takes and what loses the peer

PUT_BLOCKS, STRIPE, ACK, PUT = 12, 10, 6, 3  # (base/wire.h)
BLOCKS_STRIPED, STRIPE_OF_BLOCKS, PUT_STRIPED = 1, 16, 4


def frame(ftype, body):
    return struct.pack("<IHHQ", hs.FRAME_MAGIC, ftype, 0, len(body)) + body


def window_index(descriptor: bytes) -> int:
    """The window a region descriptor names (agent/region.cc: magic, name, incarnation, index)."""
    n = struct.unpack_from("<I", descriptor, 4)[0]
    return struct.unpack_from("<I", descriptor, 8 + n + 16)[0]


class RawPeer:
    """A connection to agent b as agent "x" with 4 lanes, its frames written by hand."""

    def __init__(self, b):
        inc = os.urandom(16)
        lane0, verdict, info = hs.dial(b.address, SECRET, hs.ident("x", lanes=4, token=9), incarnation=inc)
        assert verdict == "" and info["lanes"] == 4, (verdict, info)
        self.lanes = [lane0]
        for lane in (1, 2, 3):
            s, v, _ = hs.dial(b.address, SECRET, hs.ident("x", info["incarnation"], 4, lane, 9), incarnation=inc)
            assert v == "", v
            self.lanes.append(s)

    def striped_batch(self, win, places, data, number=1, stripe=lambda k, at, part, number: (at, part, number),
                      flags=BLOCKS_STRIPED | 3 << 8):
        """Sends a batch of writes of `data` to `places` ((offset, length) in window `win`) as the
        library stripes it over 4 lanes; `stripe` may change what lane k's stripe says."""
        total = len(data)
        part = total // 4
        first = total - 3 * part
        lst = b"".join(struct.pack("<IIQQ", win, 0, off, n) for off, n in places)
        head = struct.pack("<IIQ", len(places), flags, total)
        self.lanes[0].sendall(frame(PUT_BLOCKS, head + lst + data[:first]))
        for k in (1, 2, 3):
            at, n, num = stripe(k, first + (k - 1) * part, part, number)
            put = struct.pack("<IIQQQII", 0, 0, at, num, 0, STRIPE_OF_BLOCKS, 0)
            self.lanes[k].sendall(frame(STRIPE, put + data[at:at + n]))

    def read_ack(self, timeout=OP_TIMEOUT):
        self.lanes[0].settimeout(timeout)
        got = hs._read(self.lanes[0], 16)
        magic, ftype, _, length = struct.unpack("<IHHQ", got)
        body = hs._read(self.lanes[0], length)
        return ftype, struct.unpack("<Q", body)[0] if ftype == ACK else body

    def close(self):
        for s in self.lanes:
            s.close()


def gone(b, name, limit=OP_TIMEOUT):
    end = time.monotonic() + limit
    while b.connection(name) is not None:
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def raw_target(monkeypatch):
    with make_agent(monkeypatch, "b", 4) as b:
        dst = np.zeros(4 * MIB, np.uint8)
        win = window_index(b.register(dst).descriptor)
        peer = RawPeer(b)
        yield b, dst, win, peer
        peer.close()


def test_a_striped_batch_written_by_hand_lands_through_its_list_and_is_acked_once(raw_target):
    b, dst, win, peer = raw_target
    places = [(3 * MIB, 700_000), (17, 400_001), (MIB, 1_000_000)]  # out of order, odd sizes
    data = np.random.default_rng(1).integers(0, 256, sum(n for _, n in places), dtype=np.uint8).tobytes()
    peer.striped_batch(win, places, data)
    assert peer.read_ack() == (ACK, 1)
    want, at = np.zeros_like(dst), 0
    for off, n in places:
        want[off:off + n] = np.frombuffer(data[at:at + n], np.uint8)
        at += n
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("forgery", ["offset", "length", "number", "flags", "put"])
def test_a_stripe_that_is_not_the_part_lane_0_announced_loses_the_peer_and_lands_nothing(raw_target, forgery):
    """A stripe whose offset, length or number differs from what the checked list on lane 0
    makes of it, a list striped over another lane count, or stripes of a batch after a striped
    put's head (their number is the put's) never land a byte of it: the peer is lost (its
    connection closed) and the target serves on."""
    b, dst, win, peer = raw_target
    places = [(0, 2 * MIB)]
    data = bytes([7]) * (2 * MIB)
    part = 2 * MIB // 4
    if forgery == "put":  # lane 0: a striped put's head (its first quarter); lanes: stripes of a batch
        head = struct.pack("<IIQQQII", win, 0, 0, 0, 0, PUT_STRIPED, 3)
        peer.lanes[0].sendall(frame(PUT, head + data[:part]))
        for k in (1, 2, 3):
            put = struct.pack("<IIQQQII", 0, 0, k * part, 1, 0, STRIPE_OF_BLOCKS, 0)
            peer.lanes[k].sendall(frame(STRIPE, put + data[k * part:(k + 1) * part]))
        assert gone(b, "x"), "the peer that sent stripes of a batch after a put's head is still connected"
        assert not dst[part:].any(), "a stripe of no batch landed"
        return
    bad = {
        "offset": lambda k, at, n, num: (at + 4096 if k == 2 else at, n, num),
        "length": lambda k, at, n, num: (at, n - 4096 if k == 3 else n, num),
        "number": lambda k, at, n, num: (at, n, num + 1 if k == 1 else num),
        "flags": lambda k, at, n, num: (at, n, num),
    }[forgery]
    flags = BLOCKS_STRIPED | 1 << 8 if forgery == "flags" else BLOCKS_STRIPED | 3 << 8
    peer.striped_batch(win, places, data, stripe=bad, flags=flags)
    assert gone(b, "x"), "the peer that sent a forged stripe is still connected"
    lane = {"offset": 2, "length": 3, "number": 1, "flags": None}[forgery]
    if lane is not None:  # that lane's part never landed (the others may have)
        assert not dst[lane * part:(lane + 1) * part].any(), "the forged stripe landed"
    else:  # the list itself was refused: nothing of the batch lands
        assert not dst.any(), "a part of a batch whose list was refused landed"
    with Agent("y", SECRET, timeout=OP_TIMEOUT) as y:  # and b serves others
        src = y.register(np.ones(4096, np.uint8))
        y.connect(b.metadata()).write_sync(src, b.register(np.zeros(4096, np.uint8)), 4096)
