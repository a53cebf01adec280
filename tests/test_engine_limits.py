"""Limits and wake-ups of the progress engine: close() wakes every waiter, waits on
counters wake promptly, and a message too large for the wire is refused up front."""

import threading
import time

import numpy as np
import pytest

import flagcx_mesh
from flagcx_mesh.errors import InvalidArgument, MeshClosed

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def mesh():
    m = flagcx_mesh.Mesh(1, flagcx_mesh.get_unique_id(), 0, timeout=20)
    yield m
    m.close()


def test_close_wakes_a_wait_signal_without_timeout(mesh):
    mesh.signal_window(1)
    errors = []

    def waiter():
        try:
            mesh.wait_signal(0, 1, timeout=None)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    mesh.close()
    t.join(5)
    assert not t.is_alive(), "wait_signal still blocked after close()"
    assert time.monotonic() - t0 < 2.0
    assert len(errors) == 1 and isinstance(errors[0], MeshClosed), errors
    assert "slot 0" in str(errors[0]) and "closed" in str(errors[0])


def test_wait_counter_wakes_promptly_after_an_inline_put(mesh):
    a, b = mesh.alloc_window(64), mesh.alloc_window(64)
    woke = []

    def waiter(target):
        mesh.wait_counter(target, timeout=10)
        woke.append(time.monotonic())

    for i in range(1, 6):
        t = threading.Thread(target=waiter, args=(i,), daemon=True)
        t.start()
        time.sleep(0.05)  # the waiter is asleep on the counter by now
        t0 = time.monotonic()
        mesh.put(0, a, 0, b, 0, 8)
        t.join(5)
        assert not t.is_alive()
        # generous bound: a lost wake-up costs the 100 ms poll cap, far above this
        assert woke[-1] - t0 < 0.05, f"woke {1e3 * (woke[-1] - t0):.1f} ms after the put"


def test_a_message_over_the_wire_limit_is_refused_before_copying(mesh):
    huge = np.zeros((1 << 32) + 1, dtype=np.uint8)  # calloc'd: untouched pages cost nothing
    with pytest.raises(InvalidArgument, match="exceed the message limit"):
        mesh.send(0, huge)
    mesh.send(0, b"still fine")
    assert mesh.recv(0, timeout=5) == b"still fine"


def test_a_rank_that_cannot_register_makes_every_rank_fail_at_once():
    """Registration is collective: a rank with an unusable buffer still takes part, so the
    others fail at once naming it instead of waiting for the registration timeout; the
    next registration works on every rank with the same index."""
    from meshutil import run_threads

    uid = flagcx_mesh.get_unique_id()
    meshes = run_threads(2, lambda r: flagcx_mesh.Mesh(2, uid, r, timeout=30), timeout=60)
    try:
        def body(r):
            m = meshes[r]
            buf = b"read-only" if r == 1 else np.zeros(64, np.uint8)
            t0 = time.monotonic()
            with pytest.raises(InvalidArgument) as info:
                m.register_window(buf)
            took = time.monotonic() - t0
            w = m.register_window(np.zeros(64, np.uint8))
            return took, str(info.value), w.index

        results = run_threads(2, body, timeout=60)
        for took, _, _ in results:
            assert took < 5, f"a rank waited {took:.1f} s for the failed registration"
        assert "rank 1 could not register" in results[0][1], results[0][1]
        assert "writable" in results[1][1], results[1][1]
        assert [idx for _, _, idx in results] == [0, 0]
    finally:
        for m in meshes:
            m.close()


def test_unreceived_messages_pause_reading_instead_of_growing_memory():
    """A sender faster than the receiver's recv(): the receiver holds at most about
    max_unreceived bytes (plus what is in flight), the sender then feels back-pressure,
    and everything arrives intact once the receiver drains its mailbox."""
    from meshutil import run_threads

    uid = flagcx_mesh.get_unique_id()
    limit, msg, count = 1 << 20, 256 << 10, 600  # 150 MiB: more than the 64 MiB send queue
    # plus the socket buffers, against a 1 MiB mailbox
    meshes = run_threads(2, lambda r: flagcx_mesh.Mesh(2, uid, r, timeout=30, max_unreceived=limit),
                         timeout=60)
    try:
        def sender():
            for i in range(count):
                meshes[0].send(1, bytes([i % 251]) * msg, timeout=30)

        t = threading.Thread(target=sender, daemon=True)
        t.start()
        time.sleep(1.0)  # the receiver does not recv() yet
        assert t.is_alive(), "the sender finished: nothing held it back"
        for i in range(count):
            got = meshes[1].recv(0, timeout=30)
            assert got == bytes([i % 251]) * msg, i
        t.join(30)
        assert not t.is_alive()
    finally:
        for m in meshes:
            m.close()
