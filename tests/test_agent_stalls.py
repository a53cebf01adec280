"""No peer stalls the agent's listener or its inbox: a connection whose tcp lanes have not all
joined (a slow joiner, or one that stopped after lane 0) neither holds notifications() nor
keeps the listener from serving other peers or from taking the late lanes; a slow joiner's
lanes join while the application polls notifications (as a KV connector's thread does); and
a listener out of file descriptors backs off (no busy loop, one warning per episode, counted)
and accepts again once descriptors are freed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from flagcx_mesh.agent import Agent
import agent_handshake as hs
from meshutil import subprocess_env

pytestmark = pytest.mark.timeout(120)
SECRET = "stalls-secret"


def make_agent(monkeypatch, name, lanes, **kw):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    monkeypatch.setenv("FLAGCX_MESH_TCP_LANES", str(lanes))
    return Agent(name, SECRET, timeout=20, **kw)


class Poller:
    """Polls agent.notifications(timeout) in a loop on a thread of its own (what a connector's
    or compat.p2p's progress thread does); records the longest call."""

    def __init__(self, agent, timeout=0.05):
        self.agent, self.timeout, self.longest, self.got = agent, timeout, 0.0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            self.got += self.agent.notifications(timeout=self.timeout)
            self.longest = max(self.longest, time.monotonic() - t0)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "notifications() never returned"


def test_notifications_return_at_once_while_a_connection_awaits_its_lanes(monkeypatch):
    with make_agent(monkeypatch, "b", 4) as b:  # the lanes' deadline: the default header timeout, 5 s
        lane0, verdict, _ = hs.dial(b.address, SECRET, hs.ident("x", lanes=4, token=3))
        assert verdict == ""
        t0 = time.monotonic()
        assert b.notifications(timeout=0) == []
        took = time.monotonic() - t0
        assert took < 0.5, f"notifications(0) took {took:.2f} s while agent x's lanes were pending"
        lane0.close()


def test_a_connection_awaiting_its_lanes_does_not_stop_the_listener(monkeypatch):
    """Lane 0 admitted, its lanes never dialed (the connector stopped between them): an honest
    agent's connect with a 3 s deadline succeeds while the application polls notifications."""
    with make_agent(monkeypatch, "b", 4) as b, Poller(b) as poller:
        lane0, verdict, _ = hs.dial(b.address, SECRET, hs.ident("stuck", lanes=4, token=4))
        assert verdict == ""
        time.sleep(0.3)  # the poller has met the pending connection
        with make_agent(monkeypatch, "a", 4) as a:
            t0 = time.monotonic()
            conn = a.connect(b.metadata(), timeout=3)
            assert conn.tcp_lanes == 4 and time.monotonic() - t0 < 3
            conn.notify(b"hello")
            end = time.monotonic() + 10
            while not any(n.data == b"hello" for n in poller.got):
                assert time.monotonic() < end, "the notification never came through"
                time.sleep(0.01)
        lane0.close()
    assert poller.longest < 1.0, f"a notifications(0.05) call took {poller.longest:.2f} s"


@pytest.mark.parametrize("delay", [0.3, 2.0])
def test_a_slow_joiner_s_lanes_join_while_notifications_are_polled(monkeypatch, delay):
    """The connector's lanes come `delay` s after lane 0 (CUDA start-up, a busy host) while the
    acceptor's application polls notifications: every lane joins and the connection serves."""
    with make_agent(monkeypatch, "b", 4) as b, Poller(b) as poller:
        inc = os.urandom(16)
        lane0, verdict, info = hs.dial(b.address, SECRET, hs.ident("slow", lanes=4, token=8), incarnation=inc)
        assert verdict == "" and info["lanes"] == 4
        time.sleep(delay)
        lanes = []
        for k in (1, 2, 3):
            s, v, _ = hs.dial(b.address, SECRET, hs.ident("slow", info["incarnation"], 4, k, 8), incarnation=inc)
            assert v == "", f"lane {k} was refused after {delay} s: {v}"
            lanes.append(s)
        conn = b.connection("slow")
        assert conn is not None and conn.tcp_lanes == 4 and conn.gone() == "", conn and conn.gone()
        assert b.stats()["rejected"].get("unknown tcp lane", 0) == 0
        for s in [lane0] + lanes:
            s.close()
    assert poller.longest < 1.0, f"a notifications(0.05) call took {poller.longest:.2f} s"


EMFILE_PROG = r"""
import os, socket, sys, time
from flagcx_mesh.agent import Agent
from meshutil import take_every_descriptor
b = Agent("b", "emfile-secret", timeout=20)
host, port = b.address.rsplit(":", 1)
host = host.strip("[]")
client = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
fillers = take_every_descriptor(512)
client.connect((host, int(port)))  # the kernel completes it into the backlog: accept() has no descriptor
time.sleep(0.2)
c0 = time.process_time()
time.sleep(1.0)
cpu = time.process_time() - c0
exhausted = b.stats().get("accept_fd_exhausted", 0)
for fd in fillers:
    os.close(fd)
client.sendall(b"GET / HTTP/1.0\r\n" * 8)
end = time.monotonic() + 10
while b.stats()["rejected"].get("bad magic", 0) < 1 and time.monotonic() < end:
    time.sleep(0.01)
bad_magic = b.stats()["rejected"].get("bad magic", 0)
with Agent("a", "emfile-secret", timeout=20) as a:
    peer = a.connect(b.metadata(), timeout=10).peer_name
print("RESULT", cpu, exhausted, bad_magic, peer, flush=True)
b.close()
"""


def test_a_listener_out_of_descriptors_backs_off_and_recovers():
    """Out of descriptors (a peer holding connections without bound can do it) the listener
    neither spins nor floods the log: one warning per episode, the failed accepts counted in
    stats(); once descriptors are freed the waiting connection and new agents are served."""
    env = subprocess_env({"FLAGCX_MESH_TRANSPORT": "tcp"})  # (tests/ on PYTHONPATH: meshutil)
    p = subprocess.run([sys.executable, "-c", EMFILE_PROG], env=env, capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT"))
    _, cpu, exhausted, bad_magic, peer = line.split()
    warned = p.stderr.count("accept on the agent listener failed")
    assert warned == 1, f"{warned} warnings about accept in one episode"
    assert float(cpu) < 0.2, f"the process used {float(cpu):.2f} s of CPU in 1 s out of descriptors"
    assert int(exhausted) >= 1, "stats() did not count the failed accepts"
    assert int(bad_magic) == 1 and peer == "b", line
    assert "accepts again" in p.stderr, p.stderr[-2000:]
