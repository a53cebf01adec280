"""Unused unique ids give back their root thread and listening port: on
release_unique_id() (Python and C), and by themselves after FLAGCX_MESH_ROOT_IDLE_TIMEOUT.

Regression: every get_unique_id() started a root thread and a listening port that lived an
hour when the id was never used (200 unused ids: 200 threads, 200 fds)."""

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

import flagcx_mesh
from flagcx_mesh import Mesh, get_library, release_unique_id
from flagcx_mesh.errors import InvalidArgument

from meshutil import run_threads, wait_for

pytestmark = pytest.mark.timeout(120)


def threads_and_fds():
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def near(now, base, slack=3):
    return all(n <= b + slack for n, b in zip(now, base))


def test_200_unused_ids_released_give_back_threads_and_fds():
    base = threads_and_fds()
    ids = [flagcx_mesh.get_unique_id() for _ in range(200)]
    grown = threads_and_fds()
    assert grown[0] >= base[0] + 190 and grown[1] >= base[1] + 190, (base, grown)
    assert all(release_unique_id(uid) for uid in ids)
    assert wait_for(lambda: near(threads_and_fds(), base), 10), (base, threads_and_fds())
    assert not any(release_unique_id(uid) for uid in ids[:5])  # already ended


def test_release_of_a_used_id_is_declined_and_the_mesh_works():
    uid = flagcx_mesh.get_unique_id()
    meshes = run_threads(2, lambda r: Mesh(2, uid, r, timeout=30), timeout=45)
    try:
        assert release_unique_id(uid) is False
        assert run_threads(2, lambda r: meshes[r].allgather(b"%d" % r, timeout=20), timeout=30) == [[b"0", b"1"]] * 2
    finally:
        for m in meshes:
            m.close()


def test_release_refuses_what_is_not_an_id():
    with pytest.raises(InvalidArgument):
        release_unique_id(b"x" * 10)
    with pytest.raises(InvalidArgument):
        release_unique_id(12)


def test_c_abi_release():
    lib = ctypes.CDLL(get_library())
    uid = ctypes.create_string_buffer(256)
    base = threads_and_fds()
    assert lib.flagcx_mesh_get_unique_id(uid) == 0
    released = ctypes.c_int(-1)
    assert lib.flagcx_mesh_release_unique_id(uid, ctypes.byref(released)) == 0
    assert released.value == 1
    assert lib.flagcx_mesh_release_unique_id(uid, None) == 0  # NULL out-parameter, already ended
    assert wait_for(lambda: near(threads_and_fds(), base), 10), (base, threads_and_fds())
    assert lib.flagcx_mesh_release_unique_id(None, None) == 1  # FLAGCX_MESH_INVALID_ARGUMENT


IDLE_PROG = textwrap.dedent("""
    import os, sys, time
    import flagcx_mesh
    def count():
        return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))
    base = count()
    ids = [flagcx_mesh.get_unique_id() for _ in range(50)]
    grown = count()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(n > b + 3 for n, b in zip(count(), base)):
        time.sleep(0.1)
    print(base, grown, count())
    sys.exit(0 if grown[0] >= base[0] + 50 and all(n <= b + 3 for n, b in zip(count(), base)) else 1)
""")


def test_unused_ids_end_after_the_idle_bound():
    env = dict(os.environ, FLAGCX_MESH_ROOT_IDLE_TIMEOUT="1")
    p = subprocess.run([sys.executable, "-c", IDLE_PROG], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "abc", "10s"])
def test_bad_idle_timeout_env_is_refused(value):
    env = dict(os.environ, FLAGCX_MESH_ROOT_IDLE_TIMEOUT=value)
    prog = "import flagcx_mesh; flagcx_mesh.get_unique_id()"
    p = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "InvalidArgument" in p.stderr, p.stderr
    assert f"FLAGCX_MESH_ROOT_IDLE_TIMEOUT={value}" in p.stderr, p.stderr


LATE_PROG = textwrap.dedent("""
    import threading, time
    import flagcx_mesh
    uid = flagcx_mesh.get_unique_id()
    out = [None, None]
    def rank(r):
        time.sleep(2.5 * r)  # rank 1 joins after the idle bound (1 s) has passed
        try:
            with flagcx_mesh.Mesh(2, uid, r, timeout=20) as m:
                out[r] = m.allgather(b"ok", timeout=10)
        except Exception as e:
            out[r] = repr(e)
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    print(out)
    assert out == [[b"ok", b"ok"]] * 2
""")


def test_idle_bound_ends_only_unused_roots():
    """Once a rank has joined, the ranks' build deadline bounds the wait, not the idle bound:
    a rank arriving after FLAGCX_MESH_ROOT_IDLE_TIMEOUT still builds."""
    env = dict(os.environ, FLAGCX_MESH_ROOT_IDLE_TIMEOUT="1")
    p = subprocess.run([sys.executable, "-c", LATE_PROG], env=env, capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
