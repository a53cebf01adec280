"""Mix-ups between ranks or calls that must fail loudly, naming what was mixed up: collectives
of different kinds, registrations of different kinds, a unique id used twice or whose root is
gone, signal comparisons, a bad signal op. Ranks as threads in this process unless a test says
otherwise."""

from __future__ import annotations

import numpy as np
import pytest

import flagcx_mesh
from flagcx_mesh import InvalidArgument, Mesh, MeshError
from meshutil import run_threads

pytestmark = pytest.mark.timeout(120)


def thread_meshes(n=2):
    uid = flagcx_mesh.get_unique_id()
    return run_threads(n, lambda r: Mesh(n, uid, r, timeout=30), timeout=45)


def close_all(meshes):
    for m in meshes:
        m.close()


def test_bad_signal_op_raises_invalid_argument():
    """Regression test (issue 17, item 12): put_signal(op="xor") raised a plain ValueError,
    not the library's InvalidArgument (a MeshError)."""
    meshes = thread_meshes(2)
    try:
        def body(r):
            m = meshes[r]
            u = m.register_window(np.zeros(64, np.uint8))
            m.signal_window(1)
            for call in (lambda: m.put_signal(1 - r, u, 0, u, 0, 8, 0, op="xor"),
                         lambda: m.signal(1 - r, 0, op="xor")):
                with pytest.raises(InvalidArgument, match="'xor'") as e:
                    call()
                assert isinstance(e.value, MeshError) and f"rank {r}" in str(e.value)
            m.barrier(timeout=10)
            return True

        assert run_threads(2, body, timeout=60) == [True, True]
    finally:
        close_all(meshes)


def test_host_signal_wait_compares_like_the_stream_wait():
    """Regression test (issue 17, item 11): the host wait compared unsigned (value >= expected)
    while the stream wait (cuStreamWaitValue64 GEQ) compares cyclically; a slot at 2^63 + 5
    passed `expected=1` on the host and never on a stream. Both now use the cyclic rule:
    (int64)(value - expected) >= 0."""
    big = (1 << 63) + 5
    meshes = thread_meshes(2)
    try:
        def body(r):
            m = meshes[r]
            m.signal_window(2)
            m.barrier(timeout=10)
            m.signal(1 - r, 0, value=big, op="set")
            m.signal(1 - r, 1, value=5, op="set")
            m.flush(timeout=10)
            m.barrier(timeout=10)
            assert m.read_signal(0) == big and m.read_signal(1) == 5
            m.wait_signal(0, big, timeout=10)          # equal
            m.wait_signal(0, 1 << 63, timeout=10)      # 5 ahead
            m.wait_signal(1, (1 << 64) - 1, timeout=10)  # 5 is 6 ahead of 2^64 - 1 ("-1")
            for slot, expected in ((0, 1), (0, 5), (1, 6)):  # 2^63 + 4 and 2^63 ahead count as behind
                with pytest.raises(flagcx_mesh.MeshTimeout, match=f"slot {slot}"):
                    m.wait_signal(slot, expected, timeout=0.3)
            m.barrier(timeout=10)
            return True

        assert run_threads(2, body, timeout=60) == [True, True]
    finally:
        close_all(meshes)


def mixed_calls(calls, needles):
    """Rank r makes calls[r]; every rank must fail with InvalidArgument naming both calls,
    then a barrier and a registration work on every rank."""
    meshes = thread_meshes(2)
    try:
        def body(r):
            m = meshes[r]
            with pytest.raises(InvalidArgument) as e:
                calls[r](m)
            for needle in needles:
                assert needle in str(e.value), str(e.value)
            m.barrier(timeout=10)
            assert m.alloc_window(64).index == 0
            m.barrier(timeout=10)
            return True

        assert run_threads(2, body, timeout=60) == [True, True]
    finally:
        close_all(meshes)


def test_barrier_against_a_registration_fails_every_rank_naming_both():
    """Regression test (issue 17, item 8): rank 0's barrier() returned success while rank 1's
    signal_window() got 'rank 0 published a malformed window description'."""
    mixed_calls([lambda m: m.barrier(timeout=10), lambda m: m.signal_window(4)],
                ["rank 0 called barrier() while rank 1 called signal_window() (window #0)"])


def test_allgather_against_a_barrier_fails_every_rank():
    mixed_calls([lambda m: m.allgather(b"x", timeout=10), lambda m: m.barrier(timeout=10)],
                ["rank 0 called allgather() while rank 1 called barrier()"])


def test_registrations_of_two_kinds_fail_every_rank_naming_both():
    """Regression test (issue 17, item 9): rank 0 registering a user window while rank 1
    allocates one succeeded on both, and a put into window #0 landed in the other kind."""
    buf = [np.zeros(64, np.uint8) for _ in range(2)]
    mixed_calls([lambda m: m.register_window(buf[0]), lambda m: m.alloc_window(64)],
                ["rank 0 called register_window() (window #0) while rank 1 called alloc_window() (window #0)"])
