"""Completion patterns over tcp where an acknowledgement has no later frame to ride on.

A put's ack tells the initiator its op landed; flush and wait_counter wait for it. If acks were
only sent on the next frame the target writes anyway (piggy-backed), each pattern below would
deadlock: the target writes nothing more until the initiator's flush returns. Each one is bounded
by op timeouts (a Timeout error fails the test) and by run_threads' overall timeout (a hang
fails it too). They pass on the engine that sends acks alone; they guard changes to the ack
path and to the connections (lanes) a pair uses.

A put_signal's ack is lazy (wire version 3, kPutLazyAck): its target sends it when the
initiator asks (flush, wait_counter send a kAckReq), with the ack of a later put that is not
lazy, about a millisecond after applying it, or before its goodbye. The tests at the end check
what that must keep: FIFO per (peer, context), data before signal, a counter that catches up
without a wait, and an initiator that completes when its target closes right after its wait.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from meshutil import close_all, run_threads, thread_meshes

pytestmark = pytest.mark.timeout(180)

OP_TIMEOUT = 20.0  # every wait; far above what any pattern needs on a loaded host
ROUNDS = 50


@pytest.fixture
def tcp_pair(monkeypatch):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    meshes = thread_meshes(2, contexts=2)
    yield meshes
    close_all(meshes)


def windows(m, size):
    data = m.register_window(np.zeros(size, np.uint8))
    sig = m.signal_window(4)
    for w in (data, sig):  # the peer's copy is reached over tcp (this rank's own over self)
        assert [p for p, _ in w.paths][1 - m.rank] == "tcp", w.describe()
    return data, sig


def test_put_signal_then_flush_against_a_waiting_peer(tcp_pair):
    """Rank 0 put_signals and flushes; rank 1 only waits for that signal and then for the next
    one, which rank 0 sends after its flush returned. Nothing flows from 1 to 0 but the ack."""
    size = 4096

    def body(r):
        m = tcp_pair[r]
        data, sig = windows(m, size)
        src = m.register_window(np.arange(size, dtype=np.uint32).astype(np.uint8))
        m.barrier(timeout=30)
        for i in range(1, ROUNDS + 1):
            if r == 0:
                m.put_signal(1, src, 0, data, 0, size, 0, 1, signal_window=sig)
                m.flush(timeout=OP_TIMEOUT)
            else:
                m.wait_signal(0, i, timeout=OP_TIMEOUT, window=sig)
        if r == 1:
            got = np.frombuffer(data.buffer, np.uint8)
            assert np.array_equal(got, np.arange(size, dtype=np.uint32).astype(np.uint8))
        m.barrier(timeout=30)

    run_threads(2, body, timeout=120)


def test_ping_pong_with_flush_before_each_reply(tcp_pair):
    """Each rank put_signals the other, flushes, then waits for the other's signal: both are
    in flush at once, each owed an ack by a peer that is itself waiting."""
    size = 256

    def body(r):
        m = tcp_pair[r]
        data, sig = windows(m, size)
        src = m.register_window(np.full(size, r + 1, np.uint8))
        m.barrier(timeout=30)
        peer = 1 - r
        for i in range(1, ROUNDS + 1):
            m.put_signal(peer, src, 0, data, 0, size, 0, 1, signal_window=sig)
            m.flush(timeout=OP_TIMEOUT)
            m.wait_signal(0, i, timeout=OP_TIMEOUT, window=sig)
        assert (np.frombuffer(data.buffer, np.uint8) == peer + 1).all()
        m.barrier(timeout=30)

    run_threads(2, body, timeout=120)


def test_put_flush_against_a_peer_blocked_in_recv(tcp_pair):
    """Rank 1 sits in recv() for a message rank 0 sends only after its put's flush returned."""
    size = 1 << 16

    def body(r):
        m = tcp_pair[r]
        data, _ = windows(m, size)
        src = m.register_window(np.full(size, 7, np.uint8))
        m.barrier(timeout=30)
        for i in range(ROUNDS):
            if r == 0:
                m.put(1, src, 0, data, 0, size)
                m.flush(timeout=OP_TIMEOUT)
                m.send(1, i.to_bytes(4, "little"), timeout=OP_TIMEOUT)
            else:
                assert int.from_bytes(m.recv(0, timeout=OP_TIMEOUT), "little") == i
                assert (np.frombuffer(data.buffer, np.uint8) == 7).all()
        m.barrier(timeout=30)

    run_threads(2, body, timeout=120)


def test_flush_on_one_context_while_the_peer_waits_on_another(tcp_pair):
    """The put goes on context 1; the peer waits for a message on context 0 that follows the
    flush. An ack that waited for traffic on the put's own connection would never come."""
    size = 1024

    def body(r):
        m = tcp_pair[r]
        data, _ = windows(m, size)
        src = m.register_window(np.full(size, 3, np.uint8))
        m.barrier(timeout=30)
        for i in range(ROUNDS):
            if r == 0:
                m.put(1, src, 0, data, 0, size, context=1)
                m.flush(timeout=OP_TIMEOUT)
                m.send(1, b"next", context=0, timeout=OP_TIMEOUT)
            else:
                assert m.recv(0, context=0, timeout=OP_TIMEOUT) == b"next"
        m.barrier(timeout=30)

    run_threads(2, body, timeout=120)


def test_wait_counter_after_many_puts_to_an_idle_peer(tcp_pair):
    """Many small puts, then wait_counter for all of them, while the peer waits for a signal sent
    only afterwards: the last acks (of a batch of puts) have to go alone."""
    size, count = 64, 500

    def body(r):
        m = tcp_pair[r]
        data, sig = windows(m, size * count)
        src = m.register_window(np.arange(size * count, dtype=np.uint64).astype(np.uint8))
        m.barrier(timeout=30)
        if r == 0:
            base = m.read_counter()
            for k in range(count):
                m.put(1, src, k * size, data, k * size, size)
            m.wait_counter(base + count, timeout=OP_TIMEOUT)
            m.signal(1, 1, 1, signal_window=sig)
            m.flush(timeout=OP_TIMEOUT)
        else:
            m.wait_signal(1, 1, timeout=OP_TIMEOUT, window=sig)
            want = np.arange(size * count, dtype=np.uint64).astype(np.uint8)
            assert np.array_equal(np.frombuffer(data.buffer, np.uint8), want)
        m.barrier(timeout=30)

    run_threads(2, body, timeout=120)


def test_get_from_a_peer_waiting_for_a_signal(tcp_pair):
    """A get's answer, then a put_signal's ack, from a peer that waits for the signal."""
    size = 8192

    def body(r):
        m = tcp_pair[r]
        data, sig = windows(m, size)
        np.frombuffer(data.buffer, np.uint8)[:] = 9 if r == 1 else 0
        dst = m.register_window(np.zeros(size, np.uint8))
        m.barrier(timeout=30)
        for i in range(1, ROUNDS + 1):
            if r == 0:
                m.get(1, data, 0, dst, 0, size)
                m.flush(timeout=OP_TIMEOUT)
                assert (np.frombuffer(dst.buffer, np.uint8) == 9).all()
                m.put_signal(1, dst, 0, data, 0, 8, 0, 1, signal_window=sig)
                m.flush(timeout=OP_TIMEOUT)
            else:
                m.wait_signal(0, i, timeout=OP_TIMEOUT, window=sig)
                np.frombuffer(data.buffer, np.uint8)[:] = 9
        m.barrier(timeout=30)

    run_threads(2, body, timeout=120)


def test_lazy_put_signals_keep_fifo_and_land_before_their_signals(tcp_pair):
    """Put_signals (lazy acks) and plain puts (acked at once) mixed on two contexts: when the
    signal of op i arrives, the data of every op before it on that context has landed."""
    block, count = 512, 200

    def body(r):
        m = tcp_pair[r]
        data, sig = windows(m, 2 * block * count)
        src = m.register_window(np.zeros(block, np.uint8))
        m.barrier(timeout=30)
        if r == 0:
            base = m.read_counter()
            arr = np.frombuffer(src.buffer, np.uint8)
            for i in range(count):
                for ctx in (0, 1):
                    arr[:] = (i * 2 + ctx) % 251 + 1
                    off = (ctx * count + i) * block
                    if i % 3 == 2:
                        m.put(1, src, 0, data, off, block, context=ctx)
                        m.signal(1, ctx, 1, signal_window=sig, context=ctx)
                    else:
                        m.put_signal(1, src, 0, data, off, block, ctx, 1, signal_window=sig, context=ctx)
                    if i % 50 == 49:
                        m.flush(1, timeout=OP_TIMEOUT)
            m.wait_counter(base + sum(2 if i % 3 == 2 else 1 for i in range(count)) * 2, timeout=OP_TIMEOUT)
        else:
            got = np.frombuffer(data.buffer, np.uint8)
            for i in range(1, count + 1):
                for ctx in (0, 1):
                    m.wait_signal(ctx, i, timeout=OP_TIMEOUT, window=sig)
                    lo = ctx * count * block
                    want = np.repeat((np.arange(i) * 2 + ctx) % 251 + 1, block).astype(np.uint8)
                    assert np.array_equal(got[lo:lo + i * block], want), (ctx, i)
        m.barrier(timeout=30)

    run_threads(2, body, timeout=120)


def test_read_counter_catches_up_without_a_wait(tcp_pair):
    """No flush, no wait_counter: the lazy acks of put_signals still arrive (about 1 ms after
    their target applied them), so read_counter reaches every op issued."""
    def body(r):
        m = tcp_pair[r]
        data, sig = windows(m, 64)
        src = m.register_window(np.ones(64, np.uint8))
        m.barrier(timeout=30)
        if r == 0:
            base = m.read_counter()
            for _ in range(10):
                m.put_signal(1, src, 0, data, 0, 64, 0, 1, signal_window=sig)
            deadline = time.monotonic() + 5
            while m.read_counter() < base + 10 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert m.read_counter() == base + 10
        else:
            m.wait_signal(0, 10, timeout=OP_TIMEOUT, window=sig)
        m.barrier(timeout=30)

    run_threads(2, body, timeout=60)


def test_a_target_that_closes_right_after_its_wait_still_acks(monkeypatch):
    """Rank 1 closes its mesh as soon as the signal arrived, before the lazy ack's timer; rank 0
    flushes after that. The ack goes before rank 1's goodbye, so the flush completes."""
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    for _ in range(5):
        meshes = thread_meshes(2)
        try:
            def body(r):
                m = meshes[r]
                data, sig = windows(m, 64)
                src = m.register_window(np.ones(64, np.uint8))
                m.barrier(timeout=30)
                if r == 0:
                    m.put_signal(1, src, 0, data, 0, 64, 0, 1, signal_window=sig)
                    time.sleep(0.2)  # rank 1 has closed by now
                    m.flush(timeout=OP_TIMEOUT)
                else:
                    m.wait_signal(0, 1, timeout=OP_TIMEOUT, window=sig)
                    m.close()

            run_threads(2, body, timeout=60)
        finally:
            close_all(meshes)
