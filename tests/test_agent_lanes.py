"""tcp lanes of agent connections: a connection is as many sockets as the smaller
FLAGCX_MESH_TCP_LANES of its two agents; writes of 1 MiB or more to host regions over tcp
are striped over them and land byte for byte, with the notification after all of it; a lane
that dies fails the connection's handles with PeerLost naming the peer while the agent keeps
serving others; the listener refuses lanes that no admitted connection awaits and closes a
connection whose lanes do not all join within the header timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from flagcx_mesh import PeerLost
from flagcx_mesh.agent import Agent
import agent_handshake as hs
from meshutil import acked_since, bytes_acked, fail_with_peer_lost, fd_count, lane_sockets, shut_lane, wait_rejected

pytestmark = pytest.mark.timeout(120)
SECRET = "lanes-secret"
MIB = 1 << 20
OP_TIMEOUT = 20.0


def make_agent(monkeypatch, name, lanes, **kw):
    """An agent whose offer is `lanes` (the variable is read when the agent starts)."""
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    monkeypatch.setenv("FLAGCX_MESH_TCP_LANES", str(lanes))
    return Agent(name, SECRET, timeout=OP_TIMEOUT, **kw)


def pattern(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def wait_for(cond, limit=20.0):
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)




@pytest.mark.parametrize("offer_a,offer_b,agreed", [(4, 4, 4), (4, 2, 2), (1, 3, 1), (3, 16, 3)])
def test_a_connection_takes_the_smaller_offer_on_both_sides(monkeypatch, offer_a, offer_b, agreed):
    with make_agent(monkeypatch, "b", offer_b) as b, make_agent(monkeypatch, "a", offer_a) as a:
        conn = a.connect(b.metadata())
        assert conn.tcp_lanes == agreed
        wait_for(lambda: b.connection("a") is not None)
        assert b.connection("a").tcp_lanes == agreed


def test_a_large_write_travels_over_every_lane(monkeypatch):
    size = 16 * MIB
    with make_agent(monkeypatch, "b", 4) as b, make_agent(monkeypatch, "a", 4) as a:
        dst = np.zeros(size, np.uint8)
        remote = b.register(dst)
        src = pattern(size, 1)
        local = a.register(src)
        conn = a.connect(b.metadata())
        assert conn.path_to(remote) == "tcp"
        socks = lane_sockets(b.address)
        assert len(socks) == 4, [s.getsockname() for s in socks]
        before = [bytes_acked(s) for s in socks]
        conn.write_sync(local, remote, size)
        sent = acked_since(socks, before, size // 4)
        for s in socks:
            s.close()
        assert all(size // 4 <= n <= size // 4 + 4096 for n in sent), sent
        assert np.array_equal(dst, src)


SIZES = [MIB - 1, MIB, MIB + 1, 3 * MIB + 1, 7_777_777]


def test_striped_writes_and_reads_of_many_sizes_land_byte_for_byte_before_their_notification(monkeypatch):
    total = sum(SIZES) + 4096
    with make_agent(monkeypatch, "b", 4) as b, make_agent(monkeypatch, "a", 4) as a:
        dst = np.zeros(total, np.uint8)
        remote = b.register(dst)
        src = pattern(total, 2)
        local = a.register(src)
        back = np.zeros(total, np.uint8)
        local_back = a.register(back)
        conn = a.connect(b.metadata())
        assert conn.tcp_lanes == 4
        off = 0
        for k, n in enumerate(SIZES):  # each write notifies: its bytes are all there when it arrives
            conn.write(local, remote, n, off, off, notification=b"w%d" % k)
            got = b.notifications(timeout=OP_TIMEOUT)
            assert [x.data for x in got] == [b"w%d" % k], got
            assert np.array_equal(dst[off:off + n], src[off:off + n]), n
            off += n
        ops = []
        off = 0
        for n in SIZES:
            ops.append((local_back, off, remote, off, n))
            off += n
        conn.batch_read(ops).wait(OP_TIMEOUT)
        assert np.array_equal(back[:off], src[:off])


def test_a_later_small_write_to_the_same_bytes_wins(monkeypatch):
    size = 4 * MIB
    with make_agent(monkeypatch, "b", 4) as b, make_agent(monkeypatch, "a", 4) as a:
        dst = np.zeros(size, np.uint8)
        remote = b.register(dst)
        big = np.full(size, 1, np.uint8)
        small = np.full(size, 2, np.uint8)
        lb, ls = a.register(big), a.register(small)
        conn = a.connect(b.metadata())
        for _ in range(8):
            conn.write(lb, remote, size)
            conn.write(ls, remote, 4096, 0, size - 4096)  # the last lane's part of the big one
        conn.write_sync(ls, remote, 1, 0, 0, notification=b"end")
        assert b.notifications(timeout=OP_TIMEOUT)[0].data == b"end"
        assert (dst[size - 4096:] == 2).all() and dst[0] == 2 and (dst[1:size - 4096] == 1).all()


@pytest.mark.parametrize("lane", [0, 3])
def test_a_lane_killed_mid_write_fails_the_handle_with_peer_lost_and_others_are_served(monkeypatch, lane):
    size = 32 * MIB
    with make_agent(monkeypatch, "b", 4) as b, make_agent(monkeypatch, "a", 4) as a, \
            make_agent(monkeypatch, "c", 4) as c:
        remote = b.register(np.zeros(size, np.uint8))
        local = a.register(pattern(size, 3))
        conn = a.connect(b.metadata())
        socks = lane_sockets(b.address)
        assert len(socks) == 4
        handles = [conn.write(local, remote, size) for _ in range(8)]
        shut_lane(socks, lane)
        fail_with_peer_lost(handles, "agent b", OP_TIMEOUT)
        wait_for(lambda: b.connection("a") is None)  # b lost a too, and serves c
        cl = c.register(pattern(2 * MIB, 4))
        cc = c.connect(b.metadata())
        cc.write_sync(cl, remote, 2 * MIB)


def test_a_lane_that_no_connection_awaits_is_refused(monkeypatch):
    with make_agent(monkeypatch, "b", 4) as b:
        sock, verdict, info = hs.dial(b.address, SECRET, hs.ident("x", lanes=4, lane=1, token=12345))
        sock.close()
        assert "no connection of this agent awaits a tcp lane 1" in verdict, verdict
        assert wait_rejected(b, "unknown tcp lane") == 1
        assert b.peers() == []


def test_lane_0_answers_with_the_offer_and_the_token(monkeypatch):
    with make_agent(monkeypatch, "b", 3) as b:
        sock, verdict, info = hs.dial(b.address, SECRET, hs.ident("x", lanes=8, token=77))
        assert verdict == "" and info["lanes"] == 3 and info["lane"] == 0 and info["token"] == 77, info
        sock.close()


def test_a_lane_joins_once_with_the_agreed_lanes_and_the_token_of_its_own_agent(monkeypatch):
    with make_agent(monkeypatch, "b", 4, header_timeout=30) as b:
        inc = os.urandom(16)
        lane0, verdict, info = hs.dial(b.address, SECRET, hs.ident("x", lanes=4, token=9), incarnation=inc)
        assert verdict == "" and info["lanes"] == 4
        expect = info["incarnation"]

        def join(lane, lanes=4, token=9, name="x", incarnation=inc):
            s, v, _ = hs.dial(b.address, SECRET, hs.ident(name, expect, lanes, lane, token), incarnation=incarnation)
            return s, v

        s1, v = join(1)
        assert v == ""
        s1b, v = join(1)
        assert "joined already" in v, v
        _, v = join(2, lanes=3)
        assert "has 4 tcp lanes, not 3" in v, v
        _, v = join(2, token=10)
        assert "no connection of this agent awaits" in v, v
        _, v = join(2, name="y")
        assert "no connection of this agent awaits" in v, v
        _, v = join(2, incarnation=os.urandom(16))  # another incarnation of x
        assert "no connection of this agent awaits" in v, v
        assert wait_rejected(b, "unknown tcp lane", at_least=5) == 5


def test_a_connection_whose_lanes_do_not_join_is_closed_after_the_header_timeout(monkeypatch):
    with make_agent(monkeypatch, "b", 4, header_timeout=0.5) as b:
        lane0, verdict, _ = hs.dial(b.address, SECRET, hs.ident("x", lanes=4, token=5))
        assert verdict == ""
        assert [p[0] for p in b.peers()] == ["x"]
        lane0.settimeout(10)
        assert lane0.recv(1) == b""  # the acceptor closed it
        wait_for(lambda: b.connection("x") is None)
        with make_agent(monkeypatch, "a", 4) as a:  # and still admits a real peer
            assert a.connect(b.metadata()).tcp_lanes == 4


SPIN_PROG = r"""
import sys
import numpy as np
from flagcx_mesh.agent import Agent
size = 6 * (1 << 20) + 3
with Agent("b", "s", timeout=20) as b, Agent("a", "s", timeout=20) as a:
    dst = np.zeros(size, np.uint8)
    remote = b.register(dst)
    src = (np.arange(size) % 253).astype(np.uint8)
    conn = a.connect(b.metadata())
    for _ in range(4):
        conn.write_sync(a.register(src), remote, size)
    assert np.array_equal(dst, src)
    print("LANES", conn.tcp_lanes, flush=True)
"""


@pytest.mark.parametrize("spin", ["0", "50", "10000"])
def test_striped_writes_land_whatever_the_lane_spin(spin):
    env = dict(os.environ, FLAGCX_MESH_TRANSPORT="tcp", FLAGCX_MESH_TCP_LANES="4", FLAGCX_MESH_TCP_LANE_SPIN_US=spin)
    p = subprocess.run([sys.executable, "-c", SPIN_PROG], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "LANES 4" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("value", ["abc", "-1", "10001", "5us"])
def test_a_bad_lane_spin_fails_the_agent_naming_the_variable(value):
    env = dict(os.environ, FLAGCX_MESH_TCP_LANE_SPIN_US=value)
    p = subprocess.run([sys.executable, "-c", SPIN_PROG], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "InvalidArgument" in p.stderr, p.stdout + p.stderr
    assert f"FLAGCX_MESH_TCP_LANE_SPIN_US={value}" in p.stderr, p.stderr


def test_connections_whose_lanes_never_join_do_not_keep_their_sockets(monkeypatch):
    """Each lane 0 admitted whose lanes never join is closed at the header timeout, and its
    sockets are released then, not kept in the agent's table until someone waits for a
    notification (a peer repeating it would run the acceptor out of file descriptors)."""
    with make_agent(monkeypatch, "b", 4, header_timeout=0.3) as b:
        lane0, verdict, _ = hs.dial(b.address, SECRET, hs.ident("w", lanes=4, token=1))  # warms the listener up
        lane0.settimeout(10)
        assert verdict == "" and lane0.recv(1) == b""
        lane0.close()
        base = fd_count()
        for k in range(10):
            lane0, verdict, _ = hs.dial(b.address, SECRET, hs.ident("x%d" % k, lanes=4, token=k))
            assert verdict == ""
            lane0.settimeout(10)
            assert lane0.recv(1) == b""  # closed at the header timeout
            lane0.close()
        wait_for(lambda: fd_count() <= base + 2, limit=10)


def test_a_connector_that_closes_lane_0_before_its_lanes_join_is_dropped_at_once(monkeypatch):
    """A connector that dies (or whose lanes fail) after lane 0 was admitted: the acceptor closes
    the connection when lane 0 closes, not at the header timeout, so a connector that retries is
    not answered with the stale connection in the meantime."""
    with make_agent(monkeypatch, "b", 4, header_timeout=60) as b:
        lane0, verdict, _ = hs.dial(b.address, SECRET, hs.ident("x", lanes=4, token=3))
        assert verdict == "" and [p[0] for p in b.peers()] == ["x"]
        lane0.close()
        wait_for(lambda: b.connection("x") is None, limit=10)
        assert b.peers() == []
        _, verdict, _ = hs.dial(b.address, SECRET, hs.ident("x", lanes=4, lane=1, token=3))
        assert "no connection of this agent awaits a tcp lane 1" in verdict, verdict


def test_a_connection_dropped_for_its_lanes_keeps_other_peers_unread_notifications(monkeypatch):
    """The listener drops only the connection whose lanes did not join: a peer that notified and
    left before (its connection ended, its notification unread) is still heard."""
    with make_agent(monkeypatch, "b", 4, header_timeout=0.5) as b:
        with make_agent(monkeypatch, "c", 4) as c:
            c.connect(b.metadata()).notify(b"from c")
        wait_for(lambda: b.connection("c") is None)  # c left: its connection ended, unread
        lane0, verdict, _ = hs.dial(b.address, SECRET, hs.ident("x", lanes=4, token=6))
        assert verdict == ""
        lane0.settimeout(10)
        assert lane0.recv(1) == b""  # expired and dropped
        assert [n.data for n in b.notifications(timeout=5)] == [b"from c"]


def test_peers_that_leave_release_their_sockets_and_keep_their_notifications(monkeypatch):
    """Decodes that connect, notify and leave, over and over, while the prefill waits for no
    notification: the prefill's listener closes the ended connections (ten times a second), so
    their sockets and threads do not pile up until a notification wait; what they notified
    before leaving is still delivered, each once."""
    with make_agent(monkeypatch, "b", 4) as b:
        with make_agent(monkeypatch, "w", 4) as w:  # warms the listener and the inbox up
            w.connect(b.metadata()).notify(b"warm")
        assert [n.data for n in b.notifications(timeout=10)] == [b"warm"]
        base = fd_count()
        for k in range(10):
            with make_agent(monkeypatch, "c%d" % k, 4) as c:
                c.connect(b.metadata()).notify(b"from c%d" % k)
        wait_for(lambda: fd_count() <= base + 2, limit=10)
        got = []
        end = time.monotonic() + 10
        while len(got) < 10 and time.monotonic() < end:
            got += [n.data for n in b.notifications(timeout=1)]
        assert sorted(got) == sorted(b"from c%d" % k for k in range(10)), got


def test_a_connection_the_listener_closed_still_says_how_its_peer_left(monkeypatch):
    """The listener closes a connection whose peer said goodbye; calls on it later read that
    the peer closed it, not that it was lost."""
    with make_agent(monkeypatch, "b", 4) as b:
        with make_agent(monkeypatch, "w", 4) as w:  # warms the listener up
            w.connect(b.metadata())
        wait_for(lambda: b.connection("w") is None)
        base = fd_count()
        with make_agent(monkeypatch, "c", 4) as c:
            c.connect(b.metadata())
            wait_for(lambda: b.connection("c") is not None)
            conn = b.connection("c")
        wait_for(lambda: fd_count() <= base + 2, limit=10)  # c's sockets and b's side of them
        assert "agent c closed the connection" in conn.gone(), conn.gone()
        with pytest.raises(PeerLost, match="notify: agent c closed the connection"):
            conn.notify(b"late")


def test_connections_awaiting_their_lanes_are_bounded(monkeypatch):
    """Lane 0 admitted, lanes never joined (until the header timeout): beyond 256 at once a new
    one is refused, told why and counted, rather than filed; one that leaves makes room."""
    with make_agent(monkeypatch, "b", 4, header_timeout=60) as b:
        held = []
        try:
            for k in range(256):
                lane0, verdict, _ = hs.dial(b.address, SECRET, hs.ident("x%d" % k, lanes=4, token=k))
                assert verdict == "", (k, verdict)
                held.append(lane0)
            extra, verdict, _ = hs.dial(b.address, SECRET, hs.ident("late", lanes=4, token=999))
            extra.close()
            assert "await their tcp lanes (256)" in verdict, verdict
            assert wait_rejected(b, "too many pending connections") == 1
            assert b.connection("late") is None
            held.pop().close()
            wait_for(lambda: b.connection("x255") is None, limit=10)
            again, verdict, _ = hs.dial(b.address, SECRET, hs.ident("late", lanes=4, token=1000))
            held.append(again)
            assert verdict == "", verdict
        finally:
            for sock in held:
                sock.close()


def test_a_lane_answered_with_another_lane_count_fails_the_connect(monkeypatch):
    """The acceptor echoes the connection's lane count on every later lane; a connector that
    finds another count there fails its connect, naming it, rather than start a connection
    that the two sides count differently."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(20)
    errors = []

    def fake_acceptor():
        inc = os.urandom(16)
        socks = []
        try:
            for _ in range(4):
                s, _ = listener.accept()
                s.settimeout(20)
                socks.append(s)
                hs.accept(s, SECRET, "fake", lambda info: 4 if info["lane"] == 0 else 5, incarnation=inc)
        except (OSError, ConnectionError) as e:  # the connector gave up: expected after lane 1
            errors.append(e)
        finally:
            for s in socks:
                s.close()

    t = threading.Thread(target=fake_acceptor, daemon=True)
    t.start()
    try:
        with make_agent(monkeypatch, "a", 4) as a:
            with pytest.raises(Exception, match="lane count"):
                a.connect("127.0.0.1:%d" % listener.getsockname()[1], timeout=10)
    finally:
        listener.close()
        t.join(30)
    assert not t.is_alive()
