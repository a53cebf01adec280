"""agent.wake_notifications(): a notifications() call waiting in another thread returns at once
(what arrived, maybe nothing); a wake with no one waiting makes the next call return at once;
wakes do not add up (the call after the one that consumed it waits and gets what arrives); after
close() it does nothing. The vLLM connector's transfer thread is woken so by its commands."""

import threading
import time

import pytest

from flagcx_mesh import Agent

pytestmark = pytest.mark.timeout(60)


def waiting(agent, timeout):
    """notifications(timeout) in a thread: (thread, box of its result)."""
    box = []
    t = threading.Thread(target=lambda: box.append(agent.notifications(timeout)), daemon=True)
    t.start()
    return t, box


def test_a_waiting_call_returns_when_woken():
    with Agent("wake-a", "s", timeout=10) as a:
        t, box = waiting(a, 30)
        time.sleep(0.2)
        assert t.is_alive()  # it waits
        a.wake_notifications()
        t.join(10)
        assert not t.is_alive() and box == [[]]  # woken long before its 30 s


def test_a_wake_with_no_waiter_is_kept_for_the_next_call_only():
    with Agent("wake-b", "s", timeout=10) as a, Agent("wake-c", "s", timeout=10) as b:
        conn = b.connect(a.metadata())
        a.wake_notifications()
        a.wake_notifications()  # does not add up
        t, box = waiting(a, 30)
        t.join(10)
        assert not t.is_alive() and box == [[]]
        t, box = waiting(a, 30)  # the wake was consumed: this one waits for what arrives
        time.sleep(0.2)
        assert t.is_alive()
        conn.notify(b"kv")
        t.join(10)
        assert not t.is_alive() and [n.data for n in box[0]] == [b"kv"]


def test_after_close_a_wake_does_nothing():
    a = Agent("wake-d", "s", timeout=10)
    a.close()
    a.wake_notifications()


def test_the_c_abi_wakes_a_waiting_notification_call():
    """flagcx_mesh_agent_wake_notifications: a flagcx_mesh_agent_notification waiting in another
    thread returns TIMED_OUT (nothing came) at once, not after its 30 s."""
    import ctypes

    import flagcx_mesh

    lib = ctypes.CDLL(flagcx_mesh.get_library())
    vp, d = ctypes.c_void_p, ctypes.c_double
    lib.flagcx_mesh_agent_create.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_char_p, d]
    lib.flagcx_mesh_agent_notification.argtypes = [vp, d, ctypes.c_char_p, ctypes.c_size_t, vp,
                                                   ctypes.POINTER(ctypes.c_size_t)]
    lib.flagcx_mesh_agent_wake_notifications.argtypes = [vp]
    lib.flagcx_mesh_agent_destroy.argtypes = [vp]
    agent = vp()
    assert lib.flagcx_mesh_agent_create(ctypes.byref(agent), b"wake-c-abi", b"s", 10.0) == 0
    got = []

    def wait():
        buf, n = ctypes.create_string_buffer(64), ctypes.c_size_t(64)
        got.append(lib.flagcx_mesh_agent_notification(agent, 30.0, None, 0, buf, ctypes.byref(n)))

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    time.sleep(0.2)
    assert t.is_alive()
    assert lib.flagcx_mesh_agent_wake_notifications(agent) == 0
    t.join(10)
    assert not t.is_alive() and got == [2]  # FLAGCX_MESH_TIMED_OUT, long before 30 s
    assert lib.flagcx_mesh_agent_destroy(agent) == 0


def test_await_notifications_takes_nothing_and_is_woken():
    """await_notifications(): True once something arrived, which notifications() still returns
    (in order, nothing taken); False at its deadline, at once with no timeout, and when woken."""
    with Agent("wake-e", "s", timeout=10) as a, Agent("wake-f", "s", timeout=10) as b:
        conn = b.connect(a.metadata())
        assert a.await_notifications() is False and a.await_notifications(0) is False
        t0 = time.monotonic()
        assert a.await_notifications(0.2) is False and time.monotonic() - t0 >= 0.19
        box = []
        t = threading.Thread(target=lambda: box.append(a.await_notifications(30)), daemon=True)
        t.start()
        time.sleep(0.2)
        assert t.is_alive()
        conn.notify(b"one")
        conn.notify(b"two")
        t.join(10)
        assert box == [True]
        assert a.await_notifications(5) is True  # (still there: taken by nothing)
        got = []
        while len(got) < 2:
            got += [n.data for n in a.notifications(5)]
        assert got == [b"one", b"two"] and a.await_notifications() is False
        t = threading.Thread(target=lambda: box.append(a.await_notifications(30)), daemon=True)
        t.start()
        time.sleep(0.2)
        a.wake_notifications()
        t.join(10)
        assert not t.is_alive() and box == [True, False]
    with pytest.raises(Exception, match="closed"):
        a.await_notifications(0)


def test_the_c_abi_awaits_notifications_taking_nothing():
    """flagcx_mesh_agent_await_notifications: *ready 1 once something arrived, which
    flagcx_mesh_agent_notification still returns one by one in order (those it took past the one
    it handed out go back to the agent: an await after it sees them; before, the C ABI kept them
    in a queue of its own that no wait could see), 0 at the deadline and when woken; a taker
    waiting with the agent's lock held does not hold an await up."""
    import ctypes

    import flagcx_mesh

    lib = ctypes.CDLL(flagcx_mesh.get_library())
    vp, d, sz = ctypes.c_void_p, ctypes.c_double, ctypes.c_size_t
    for name, args in {"agent_create": [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_char_p, d],
                       "agent_metadata": [vp, vp, ctypes.POINTER(sz)], "agent_destroy": [vp],
                       "agent_notification": [vp, d, ctypes.c_char_p, sz, vp, ctypes.POINTER(sz)],
                       "agent_await_notifications": [vp, d, ctypes.POINTER(ctypes.c_int)],
                       "agent_wake_notifications": [vp]}.items():
        getattr(lib, "flagcx_mesh_" + name).argtypes = args
    agent, ready = vp(), ctypes.c_int(7)
    assert lib.flagcx_mesh_agent_create(ctypes.byref(agent), b"await-c-abi", b"s", 10.0) == 0

    def take(timeout):
        buf, n = ctypes.create_string_buffer(64), sz(64)
        rc = lib.flagcx_mesh_agent_notification(agent, timeout, None, 0, buf, ctypes.byref(n))
        return buf.raw[:n.value] if rc == 0 else rc

    def await_(timeout):
        assert lib.flagcx_mesh_agent_await_notifications(agent, timeout, ctypes.byref(ready)) == 0
        return ready.value

    try:
        meta, n = ctypes.create_string_buffer(4096), sz(4096)
        assert lib.flagcx_mesh_agent_metadata(agent, meta, ctypes.byref(n)) == 0
        assert await_(0) == 0 and await_(0.1) == 0
        assert lib.flagcx_mesh_agent_await_notifications(agent, -1.0, ctypes.byref(ready)) == 1  # INVALID_ARGUMENT
        with Agent("await-c-peer", "s", timeout=10) as b:
            conn = b.connect(meta.raw[:n.value])
            taker = []
            t = threading.Thread(target=lambda: taker.append(take(30.0)), daemon=True)
            t.start()  # (waits holding the C agent's lock)
            time.sleep(0.2)
            assert await_(0.1) == 0  # not held up by the taker
            for m in (b"one", b"two", b"three"):
                conn.notify(m)
            t.join(10)
            assert taker == [b"one"]
            end = time.monotonic() + 10
            while time.monotonic() < end and await_(0.1) == 0:  # (two and three: maybe not drained yet)
                pass
            assert ready.value == 1 and take(5.0) == b"two"
            assert await_(5.0) == 1 and take(5.0) == b"three"
            assert await_(0) == 0 and take(0.05) == 2  # FLAGCX_MESH_TIMED_OUT
            t = threading.Thread(target=lambda: taker.append(await_(30.0)), daemon=True)
            t.start()
            time.sleep(0.2)
            assert lib.flagcx_mesh_agent_wake_notifications(agent) == 0
            t.join(10)
            assert not t.is_alive() and taker == [b"one", 0]
    finally:
        assert lib.flagcx_mesh_agent_destroy(agent) == 0
