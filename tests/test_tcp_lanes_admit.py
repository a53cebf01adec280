"""tcp lanes: early admission of striped puts at the target.

FLAGCX_MESH_TCP_LANES=4 with tcp forced. While a striped put's stripes are still landing, lane 0
reads on into the next frame and admits it at once when it is a striped put of the same layout
(window, offset, length); any other frame waits until the earlier puts were applied. Puts are
applied in order, each once every lane landed its stripe: a signal is never visible before its
put's bytes (nor an earlier put's), a small put or a get between two striped puts sits between
them, puts of other layouts (even one whose lane-0 part is as long as the previous one's) keep
their order, flush and wait_counter count each put once, and a lane killed with several puts
admitted fails both sides with PeerLost. Every wait is bounded, run_threads bounds each test.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

import flagcx_mesh
from flagcx_mesh import PeerLost
from meshutil import close_all, run_threads, thread_meshes
from test_tcp_lanes import lane_socket, pattern

pytestmark = pytest.mark.timeout(120)

OP_TIMEOUT = 20.0
MIB = 1 << 20


@pytest.fixture
def lanes4(monkeypatch):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    monkeypatch.setenv("FLAGCX_MESH_TCP_LANES", "4")
    meshes = thread_meshes(2)
    yield meshes
    close_all(meshes)


def numbered_windows(m, size, count):
    """Collective: a zeroed destination of `size` bytes, one signal slot, and a source whose
    k-th `size` bytes are all byte k + 1 (k < count)."""
    dst = m.register_window(np.zeros(size, np.uint8))
    m.signal_window(1)
    src = m.register_window(np.repeat(np.arange(1, count + 1, dtype=np.uint8), size))
    m.barrier(timeout=30)
    return dst, src


def test_a_signal_never_shows_before_its_put_and_the_earlier_ones(lanes4):
    """Rank 0 queues 40 put_signals of one layout (2 MiB + 5 bytes, all of byte k for put k,
    each adding 1), then waits for their count. Rank 1 polls the signal: once it reads k, every
    byte is k or more (put k and every earlier one landed whole); at the end every byte is the
    last put's. A put applied once a total of stripes landed, not every lane's, or out of
    order, shows a byte below k."""
    size, count = 2 * MIB + 5, 40

    def body(r):
        m = lanes4[r]
        dst, src = numbered_windows(m, size, count)
        for rnd in range(12):  # 3 rounds, more while no put was admitted early (a busy machine)
            if r == 0:
                start = m.read_counter()
                for k in range(count):
                    m.put_signal(1, src, k * size, dst, 0, size, 0, 1)
                m.wait_counter(start + count, timeout=OP_TIMEOUT)
                m.flush(timeout=OP_TIMEOUT)
                assert m.read_counter() == start + count
            else:
                b = np.frombuffer(dst.buffer, np.uint8)
                deadline, seen = time.monotonic() + OP_TIMEOUT, 0
                while seen < count:
                    seen = m.read_signal(0) - rnd * count
                    low = int(b.min()) if seen > 0 else 0  # read after the signal: later bytes only grow
                    assert low >= seen, (rnd, seen, low)
                    assert time.monotonic() < deadline, f"signal at {seen} of {count}"
                assert m.read_signal(0) == (rnd + 1) * count
                assert (b == count).all(), rnd
                b[:] = 0
                word = b"done" if rnd >= 2 and m.stats()["tcp_early_admits"] > 0 else b"more"
                m.send(0, word)
            if r == 0:
                word = m.recv(1, timeout=OP_TIMEOUT)
            if word == b"done":
                break
            m.barrier(timeout=30)
        if r == 1:  # the case under test was there: puts admitted while earlier ones landed
            assert m.stats()["tcp_early_admits"] > 0, m.stats()

    run_threads(2, body, timeout=100)


def test_ops_between_striped_puts_of_one_layout_land_between_them(lanes4):
    """Two striped puts of A and A2 (one layout), a small put of B into the middle of lane 2's
    stripe, a message, a get of the whole window, then two striped puts of C and C2 (that
    layout again) and a signal. The get sees A2 with B (after both puts, before C), the message
    arrives whole, and the window ends as C2. A small put or get acted on while A's stripes
    land, or one held until after C, shows other bytes."""
    size, small = 4 * MIB + 3, 4096
    at = size // 2 + 1000  # inside lane 2's stripe

    def body(r):
        m = lanes4[r]
        dst = m.register_window(np.zeros(size, np.uint8))
        m.signal_window(1)
        seeds = (50, 51, 52, 53, 54)
        a, a2, b, c, c2 = (m.register_window(pattern(size, s)) for s in seeds)
        back = m.register_window(np.zeros(size, np.uint8))
        m.barrier(timeout=30)
        for i in range(1, 6):
            if r == 0:
                m.put(1, a, 0, dst, 0, size)
                m.put(1, a2, 0, dst, 0, size)
                m.put(1, b, at, dst, at, small)
                m.send(1, pattern(3 * small, i).tobytes())
                m.get(1, dst, 0, back, 0, size)
                m.put(1, c, 0, dst, 0, size)
                m.put(1, c2, 0, dst, 0, size)
                m.signal(1, 0, 1)
                m.flush(timeout=OP_TIMEOUT)
                want = pattern(size, 51)
                want[at:at + small] = pattern(size, 52)[at:at + small]
                got = np.frombuffer(back.buffer, np.uint8)
                assert np.array_equal(got, want), (i, np.flatnonzero(got != want)[:5])
            else:
                m.wait_signal(0, i, timeout=OP_TIMEOUT)
                assert np.array_equal(np.frombuffer(dst.buffer, np.uint8), pattern(size, 54)), i
                assert m.recv(0, timeout=OP_TIMEOUT) == pattern(3 * small, i).tobytes()
            m.barrier(timeout=30)

    run_threads(2, body, timeout=100)


def test_striped_puts_of_other_layouts_back_to_back_keep_their_order(lanes4):
    """Puts of other layouts queued back to back over one window: 4 MiB, then 4 MiB - 3 (its
    lane-0 part is as long, its stripes each start a byte or more earlier), another offset, a
    1 MiB one, another window... then a signal. The window ends as the puts applied in order;
    a stripe landed before the earlier put's stripe on another lane under the same bytes
    leaves that earlier put's byte."""
    size = 4 * MIB + 64
    layouts = [(0, 4 * MIB), (0, 4 * MIB - 3), (0, 4 * MIB), (0, 4 * MIB - 3), (7, 2 * MIB + 1),
               (0, 4 * MIB - 3), (64, 4 * MIB), (3, MIB), (0, 4 * MIB), (0, 4 * MIB - 3)]

    def body(r):
        m = lanes4[r]
        dst, other = (m.register_window(np.zeros(size, np.uint8)) for _ in range(2))
        m.signal_window(1)
        srcs = [m.register_window(pattern(size, 60 + k)) for k in range(len(layouts))]
        m.barrier(timeout=30)
        want = np.zeros(size, np.uint8)
        for k, (off, n) in enumerate(layouts):
            want[off:off + n] = pattern(size, 60 + k)[off:off + n]
        for i in range(1, 9):
            if r == 0:
                for k, (off, n) in enumerate(layouts):
                    m.put(1, srcs[k], off, dst, off, n)
                    if k == 4:
                        m.put(1, srcs[k], 0, other, 0, 4 * MIB)  # another window between
                m.signal(1, 0, 1)
                m.flush(timeout=OP_TIMEOUT)
            else:
                m.wait_signal(0, i, timeout=OP_TIMEOUT)
                got = np.frombuffer(dst.buffer, np.uint8)
                assert np.array_equal(got, want), (i, np.flatnonzero(got != want)[:5])
                got[:] = 0
            m.barrier(timeout=30)

    run_threads(2, body, timeout=100)


KILL_ROUNDS = 8


def admitted_early_with_puts_left(m, base, count):
    """Rank 1's look at one round of `count` put_signals (its signal started at `base`): True
    once two or more were applied and a put was admitted early in this round while puts are
    still to come; False when the round ended without that (the lane-0 reader then never ran
    ahead of the stripes: a matter of scheduling on a busy machine)."""
    early = m.stats()["tcp_early_admits"]
    deadline = time.monotonic() + OP_TIMEOUT
    while time.monotonic() < deadline:
        applied = m.read_signal(0) - base
        if applied >= count:
            return False
        if applied >= 2 and m.stats()["tcp_early_admits"] > early:
            return True
        time.sleep(0.0005)
    raise AssertionError(f"round from signal {base}: {m.read_signal(0) - base} of {count} applied")


@pytest.mark.parametrize("lane", [0, 1])
def test_a_lane_killed_with_several_puts_admitted_fails_both_sides_with_peer_lost(lanes4, lane):
    """Rank 0 queues rounds of 16 put_signals of one layout (16 MiB each, several admitted at
    once at rank 1). In the first round where rank 1 sees two of them applied and a put admitted
    early with puts still to come, it says so and rank 0 shuts one lane's socket (a round that
    ends without that is repeated, up to KILL_ROUNDS). Rank 0's flush and rank 1's wait for the
    last signal fail with PeerLost naming the other rank within their timeouts; the signals
    applied are a prefix of the round's puts, each of them whole (never one of a put cut
    short)."""
    size, count = 16 * MIB, 16

    def body(r):
        m = lanes4[r]
        dst, src = numbered_windows(m, size, count)
        if r == 0:
            sock = lane_socket(m, 1, lane)
            for _ in range(KILL_ROUNDS):
                for k in range(count):
                    m.put_signal(1, src, k * size, dst, 0, size, 0, 1)
                word = m.recv(1, timeout=OP_TIMEOUT)
                if word == b"kill":
                    break
                assert word == b"again", word
                m.flush(timeout=OP_TIMEOUT)
            assert word == b"kill", f"no put admitted early in {KILL_ROUNDS} rounds"
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with pytest.raises(PeerLost) as e:
                m.flush(timeout=OP_TIMEOUT)
            assert "peer 1" in str(e.value), e.value
        else:
            for rnd in range(KILL_ROUNDS):
                base = rnd * count
                hit = admitted_early_with_puts_left(m, base, count)
                if not hit:  # every put of the round was applied: the next round starts from zeros
                    np.frombuffer(dst.buffer, np.uint8)[:] = 0
                m.send(0, b"kill" if hit else b"again")
                if hit:
                    break
            assert hit, f"no put admitted early in {KILL_ROUNDS} rounds: {m.stats()}"
            start = time.monotonic()
            with pytest.raises(PeerLost) as e:
                m.wait_signal(0, base + count + 1, timeout=OP_TIMEOUT)
            assert time.monotonic() - start < OP_TIMEOUT / 2, "PeerLost came late"
            assert "peer 0" in str(e.value) or "rank 0" in str(e.value), e.value
            applied = m.read_signal(0) - base
            assert 2 <= applied <= count, applied
            assert int(np.frombuffer(dst.buffer, np.uint8).min()) >= applied, applied
        # Closing the window fails on both ranks (rank 0's flush names its lost peer, and rank 1
        # hears that rank 0 could not close it), at once: the stripes and held puts of the lost
        # peer left rank 1's window (rank 1 waited out its timeout before, MeshTimeout "still
        # used by N operation(s)").
        start = time.monotonic()
        with pytest.raises(flagcx_mesh.MeshError) as e:
            dst.close()
        assert "still used" not in str(e.value), e.value
        assert time.monotonic() - start < 10, "closing the window waited for the lost peer's stripes"

    run_threads(2, body, timeout=100)


def test_flush_and_wait_counter_count_pipelined_striped_puts_once(lanes4):
    """Striped puts of one layout queued back to back, then small ones, then more striped ones:
    wait_counter reaches exactly their count and flush returns with nothing left."""
    size, n = 3 * MIB + 1, 10

    def body(r):
        m = lanes4[r]
        dst = m.register_window(np.zeros(size, np.uint8))
        src = m.register_window(pattern(size, 70))
        m.barrier(timeout=30)
        if r == 0:
            start = m.read_counter()
            for k in range(n):
                m.put(1, src, 0, dst, 0, size)
                if k % 4 == 3:
                    m.put(1, src, 0, dst, 0, 100)
            total = n + n // 4
            m.wait_counter(start + total, timeout=OP_TIMEOUT)
            m.flush(timeout=OP_TIMEOUT)
            assert m.read_counter() == start + total
        m.barrier(timeout=30)
        if r == 1:
            assert np.array_equal(np.frombuffer(dst.buffer, np.uint8), pattern(size, 70))

    run_threads(2, body, timeout=60)
