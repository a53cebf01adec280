"""Agent names: a live agent is never superseded by another process claiming its name. A second
live agent of a name is refused, naming it, both when it connects and when it is connected to,
and the first keeps every connection (to a third agent too); a restarted agent whose old
incarnation hangs is admitted once that one stops answering (within 2 s), and what the old
incarnation delivered and nobody read yet stays readable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from flagcx_mesh import InvalidArgument
from flagcx_mesh.agent import Agent
from meshutil import wait_stopped

pytestmark = pytest.mark.timeout(120)
SECRET = "names-secret"
PROBE_LIMIT = 2.0  # NameProbe::kLimitS


def collect(agent, want, limit=20.0):
    """Notifications until `want` of them arrived (bounded)."""
    got, end = [], time.monotonic() + limit
    while len(got) < want and time.monotonic() < end:
        got += agent.notifications(timeout=0.1)
    return got


def test_a_second_live_agent_of_a_name_is_refused_and_the_first_keeps_its_connection(monkeypatch):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    with Agent("b", SECRET, timeout=20) as b, Agent("x", SECRET, timeout=20) as x1, \
            Agent("x", SECRET, timeout=20) as x2:
        dst = np.zeros(64, np.uint8)
        remote = b.register(dst)
        conn = x1.connect(b.metadata(), timeout=10)  # the victim's connection to a third agent
        src = x1.register(np.full(64, 7, np.uint8))
        conn.write_sync(src, remote, 64, notification=b"one")
        t0 = time.monotonic()
        with pytest.raises(InvalidArgument, match="agent x is alive") as e:
            x2.connect(b.metadata(), timeout=10)
        assert time.monotonic() - t0 < PROBE_LIMIT, "a live agent's answer took the probe's whole limit"
        assert "refused this agent" in str(e.value) and x1.incarnation in str(e.value), e.value
        assert conn.gone() == "", conn.gone()
        conn.write_sync(src, remote, 64, notification=b"two")
        notes = collect(b, 2)
        assert [(n.peer, n.incarnation, n.data) for n in notes] == [("x", x1.incarnation, b"one"),
                                                                   ("x", x1.incarnation, b"two")]
        assert [(p[0], p[1]) for p in b.peers()] == [("x", x1.incarnation)]
        assert b.stats()["rejected"].get("name in use by a live agent") == 1
        assert x2.peers() == []


def test_connecting_to_a_second_live_agent_of_a_name_is_refused(monkeypatch):
    """b is connected to c; another live agent named c is refused whichever side dials, and b's
    connection to the first c keeps working."""
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    with Agent("b", SECRET, timeout=20) as b, Agent("c", SECRET, timeout=20) as c1, \
            Agent("c", SECRET, timeout=20) as c2:
        conn = b.connect(c1.metadata(), timeout=10)
        with pytest.raises(InvalidArgument, match="agent c is alive"):
            b.connect(c2.metadata(), timeout=10)  # refused before it dials
        with pytest.raises(InvalidArgument, match="agent c is alive"):
            b.connect(c2.address, timeout=10)  # learnt only in the handshake: c2 sees that connection end
        end = time.monotonic() + 10
        while c2.connection("b") is not None:
            assert time.monotonic() < end, "c2 kept b's refused connection"
            time.sleep(0.01)
        with pytest.raises(InvalidArgument, match="agent c is alive"):
            c2.connect(b.metadata(), timeout=10)
        assert conn.gone() == ""
        conn.notify(b"still")
        assert [n.data for n in collect(c1, 1)] == [b"still"]
        assert [(p[0], p[1]) for p in b.peers()] == [("c", c1.incarnation)]


OLD_PROG = r"""
import sys
from flagcx_mesh.agent import Agent
with Agent("x", sys.argv[2], timeout=20) as a:
    c = a.connect(bytes.fromhex(sys.argv[1]), timeout=10)
    c.notify(b"old-1")
    c.notify(b"old-2")
    print("INC", a.incarnation, flush=True)
    sys.stdin.read()
"""


def stop(proc):
    proc.send_signal(signal.SIGSTOP)
    wait_stopped(proc.pid, "the old incarnation")


@pytest.mark.parametrize("how", ["hangs", "died"])
def test_a_restart_is_admitted_and_the_old_incarnation_s_unread_notifications_stay(monkeypatch, how):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    with Agent("b", SECRET, timeout=20) as b:
        old = subprocess.Popen([sys.executable, "-c", OLD_PROG, b.metadata().hex(), SECRET], text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ))
        try:
            line = old.stdout.readline().split()
            assert line and line[0] == "INC", line
            old_inc = line[1]
            end = time.monotonic() + 10
            while not any(p[1] == old_inc for p in b.peers()):
                assert time.monotonic() < end, "the old incarnation never connected"
                time.sleep(0.01)
            time.sleep(0.2)  # its notifications are in b's engine; nobody reads them
            if how == "hangs":
                stop(old)  # its connection stays open, and answers nothing
            else:
                old.kill()
                old.wait(30)
            with Agent("x", SECRET, timeout=20) as new:
                t0 = time.monotonic()
                result = {}
                t = threading.Thread(target=lambda: result.update(conn=new.connect(b.metadata(), timeout=10)))
                t.start()
                if how == "hangs":  # while b probes the old incarnation, it serves others
                    time.sleep(0.3)
                    with Agent("y", SECRET, timeout=20) as y:
                        t1 = time.monotonic()
                        y.connect(b.metadata(), timeout=3)
                        assert time.monotonic() - t1 < 1.0
                    assert t.is_alive(), "the hung old incarnation was not probed"
                t.join(30)
                took = time.monotonic() - t0
                conn = result.get("conn")
                assert conn is not None, "the restart's connect failed"
                assert took < PROBE_LIMIT + 2, f"the restart was admitted after {took:.2f} s"
                conn.notify(b"new-1")
                notes = collect(b, 3)
                assert [(n.incarnation, n.data) for n in notes] == [(old_inc, b"old-1"), (old_inc, b"old-2"),
                                                                   (new.incarnation, b"new-1")]
                assert [(p[0], p[1]) for p in b.peers() if p[0] == "x"] == [("x", new.incarnation)]
        finally:
            old.kill()
            old.communicate(timeout=30)
