"""Agent.wait_notification: a host wait for one peer's notification. It returns the
notification whether it came before or after the call, consumes only that one (others stay
for notifications()), fails with PeerLost naming the peer soon after that peer is killed,
with MeshTimeout at its timeout and MeshClosed when the agent closes; the C ABI's
flagcx_mesh_agent_wait_notification does the same for arrival and timeout, and a buffer too
short leaves the notification queued."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time

import pytest

import flagcx_mesh
from flagcx_mesh import Agent
from flagcx_mesh.errors import InvalidArgument, MeshClosed, MeshTimeout, PeerLost

pytestmark = pytest.mark.timeout(60)

SECRET = "wait-notification"

# A peer in its own process: connects to the target, says it is there, and sleeps until killed.
DOOMED = """
import sys, time
from flagcx_mesh import Agent
a = Agent("doomed", sys.argv[1], timeout=10)
a.connect(bytes.fromhex(sys.argv[2]))
print("connected", flush=True)
time.sleep(60)
"""


@pytest.fixture
def pair():
    with Agent("target", SECRET, timeout=10) as t, Agent("source", SECRET, timeout=10) as s:
        yield t, s, s.connect(t.metadata())


def later(seconds, fn):
    th = threading.Timer(seconds, fn)
    th.start()
    return th


def test_a_notification_already_there_returns_at_once(pair):
    t, _, conn = pair
    conn.notify(b"kv ready")
    time.sleep(0.2)
    n = t.wait_notification("source", timeout=5)
    assert (n.peer, n.data) == ("source", b"kv ready")
    assert t.notifications(0) == []  # consumed


def test_a_notification_sent_after_the_call_returns_it(pair):
    t, _, conn = pair
    th = later(0.3, lambda: conn.notify(b"late"))
    start = time.monotonic()
    n = t.wait_notification("source", timeout=5, data=b"late")
    th.join()
    assert n.data == b"late" and time.monotonic() - start < 4


def test_only_the_matching_notification_is_consumed(pair):
    t, s, conn = pair
    with Agent("other", SECRET, timeout=10) as o:
        o.connect(t.metadata()).notify(b"from other")
        conn.notify(b"first")
        conn.notify(b"wanted")
        time.sleep(0.2)
        assert t.wait_notification("source", timeout=5, data=b"wanted").data == b"wanted"
        left = t.notifications(2)
        deadline = time.monotonic() + 5
        while len(left) < 2 and time.monotonic() < deadline:
            left += t.notifications(0.5)
        assert sorted((n.peer, n.data) for n in left) == [("other", b"from other"), ("source", b"first")]


def test_a_killed_peer_fails_the_wait_with_peer_lost_naming_it():
    timeout = 8.0
    with Agent("target", SECRET, timeout=10) as t:
        child = subprocess.Popen([sys.executable, "-c", DOOMED, SECRET, t.metadata().hex()],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "connected"
            later(0.3, child.kill)
            start = time.monotonic()
            with pytest.raises(PeerLost, match="doomed") as e:
                t.wait_notification("doomed", timeout=timeout)
            assert time.monotonic() - start < timeout / 2, e.value
        finally:
            child.kill()
            child.wait(timeout=10)


def test_no_notification_times_out(pair):
    t, _, conn = pair
    conn.notify(b"not this one")
    start = time.monotonic()
    with pytest.raises(MeshTimeout, match="source"):
        t.wait_notification("source", timeout=0.5, data=b"never")
    assert 0.4 < time.monotonic() - start < 4
    assert [n.data for n in t.notifications(1)] == [b"not this one"]


def test_closing_the_agent_ends_the_wait_with_mesh_closed(pair):
    t, _, _ = pair
    th = later(0.3, t.close)
    start = time.monotonic()
    with pytest.raises(MeshClosed):
        t.wait_notification("source", timeout=8)
    th.join()
    assert time.monotonic() - start < 4
    with pytest.raises(MeshClosed):
        t.wait_notification("source", timeout=1)


@pytest.mark.parametrize("bad", [-1, float("nan"), -float("inf"), "soon"])
def test_a_bad_timeout_is_refused_naming_it(pair, bad):
    with pytest.raises(InvalidArgument, match="timeout"):
        pair[0].wait_notification("source", timeout=bad)


def c_lib():
    lib = ctypes.CDLL(flagcx_mesh.get_library())
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.flagcx_mesh_agent_create.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_double]
    lib.flagcx_mesh_agent_metadata.argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(sz)]
    lib.flagcx_mesh_agent_wait_notification.argtypes = [vp, ctypes.c_char_p, ctypes.c_void_p, sz, ctypes.c_double,
                                                        ctypes.c_char_p, ctypes.POINTER(sz)]
    lib.flagcx_mesh_agent_destroy.argtypes = [vp]
    lib.flagcx_mesh_last_error.restype = ctypes.c_char_p
    return lib


def test_the_c_abi_waits_for_arrival_and_times_out():
    lib = c_lib()
    agent = ctypes.c_void_p()
    assert lib.flagcx_mesh_agent_create(ctypes.byref(agent), b"c-target", SECRET.encode(), 10.0) == 0
    try:
        md, n = ctypes.create_string_buffer(4096), ctypes.c_size_t(4096)
        assert lib.flagcx_mesh_agent_metadata(agent, md, ctypes.byref(n)) == 0
        with Agent("c-source", SECRET, timeout=10) as s:
            conn = s.connect(md.raw[:n.value])
            th = later(0.3, lambda: conn.notify(b"kv ready"))
            buf, length = ctypes.create_string_buffer(64), ctypes.c_size_t(64)
            rc = lib.flagcx_mesh_agent_wait_notification(agent, b"c-source", b"kv ready", 8, 5.0, buf,
                                                         ctypes.byref(length))
            th.join()
            assert rc == 0, lib.flagcx_mesh_last_error()
            assert buf.raw[:length.value] == b"kv ready"
            length = ctypes.c_size_t(64)
            start = time.monotonic()
            rc = lib.flagcx_mesh_agent_wait_notification(agent, b"c-source", None, 0, 0.5, buf, ctypes.byref(length))
            assert rc == 2 and b"c-source" in lib.flagcx_mesh_last_error()  # FLAGCX_MESH_TIMED_OUT
            assert 0.4 < time.monotonic() - start < 4
            conn.notify(b"twelve bytes")
            short = ctypes.c_size_t(4)
            rc = lib.flagcx_mesh_agent_wait_notification(agent, b"c-source", None, 0, 5.0, buf, ctypes.byref(short))
            assert rc == 1 and short.value == 12  # INVALID_ARGUMENT, the size needed; it stays queued
            length = ctypes.c_size_t(64)
            rc = lib.flagcx_mesh_agent_wait_notification(agent, b"c-source", None, 0, 5.0, buf, ctypes.byref(length))
            assert rc == 0 and buf.raw[:length.value] == b"twelve bytes", lib.flagcx_mesh_last_error()
            for bad in (-1.0, float("nan")):
                rc = lib.flagcx_mesh_agent_wait_notification(agent, b"c-source", None, 0, bad, buf, ctypes.byref(length))
                assert rc == 1 and b"timeout" in lib.flagcx_mesh_last_error()
    finally:
        lib.flagcx_mesh_agent_destroy(agent)
