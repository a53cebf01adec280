"""Mix-ups between ranks or calls that must fail loudly, naming what was mixed up: collectives
of different kinds, registrations of different kinds, a unique id used twice or whose root is
gone, signal comparisons, a bad signal op. Ranks as threads in this process unless a test says
otherwise."""

from __future__ import annotations

import os
import subprocess
import textwrap

import numpy as np
import pytest

import flagcx_mesh
from flagcx_mesh import InvalidArgument, Mesh, MeshError
from meshutil import PY, run_threads, subprocess_env, close_all, thread_meshes

pytestmark = pytest.mark.timeout(120)


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


def test_a_used_unique_id_fails_at_once_saying_so():
    """Regression test (issue 17, item 10): a rank joining with the id of a mesh already built
    (a late duplicate, a stale id) waited out its whole timeout, then said 'cannot reach the
    bootstrap root ... Connection refused'. The root's listener closes once its mesh is built:
    a refused connection to a root on this host now fails at once, saying the id was used."""
    uid = flagcx_mesh.get_unique_id()
    meshes = run_threads(2, lambda r: Mesh(2, uid, r, timeout=30), timeout=45)
    try:
        with pytest.raises(InvalidArgument, match="already used") as e:
            Mesh(2, uid, 1, timeout=20)
        assert "serves one mesh" in str(e.value), str(e.value)
    finally:
        close_all(meshes)


LAUNCHED_TWICE = textwrap.dedent("""
    import flagcx_mesh
    from flagcx_mesh import InvalidArgument, Mesh
    m = Mesh.from_env(timeout=20)
    m.barrier(timeout=20)
    try:
        Mesh.from_env(timeout=20)
        print("SECOND BUILT", flush=True)
    except InvalidArgument as e:
        print("REFUSED", e, flush=True)
    m.close()
""")


def test_a_second_from_env_under_the_launcher_says_the_id_was_used(tmp_path):
    """Regression test (issue 17, item 10): a second Mesh.from_env() under the embedded
    launcher waited out its timeout, then said 'Connection refused'."""
    prog = tmp_path / "twice.py"
    prog.write_text(LAUNCHED_TWICE)
    cmd = [PY, "-m", "flagcx_mesh.launch", "-n", "2", "--timeout", "90", "--", PY, str(prog)]
    p = subprocess.run(cmd, env=subprocess_env(), cwd=os.path.dirname(__file__), capture_output=True,
                       text=True, timeout=110)
    assert p.returncode == 0, p.stdout + p.stderr
    refused = [line for line in p.stdout.splitlines() if "REFUSED" in line]
    assert len(refused) == 2 and all("already used" in line for line in refused), p.stdout + p.stderr
