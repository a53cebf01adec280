"""Waiters that read their peers' tcp connections themselves (core/progress_poll.cc): while
wait_signal, flush or wait_counter spin, they read lane 0 when no other thread does, and the
progress thread leaves lane 0 to them (parked) for up to a millisecond at a time.

A peer that dies while that goes on must still fail the waiter with PeerLost naming it, within
the timeout: the dead peer's end of stream may be read by the waiter, not by the progress
thread. The peer here is a child process that ping-pongs put_signals with this one (so the
waiters read and the progress thread is parked) and then SIGKILLs itself."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

import flagcx_mesh
from flagcx_mesh import Mesh, PeerLost
from meshutil import subprocess_env

pytestmark = pytest.mark.timeout(120)

ROUNDS = 2000

CHILD = r"""
import os, signal, sys
import numpy as np
from flagcx_mesh import Mesh

uid, rounds, how = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
m = Mesh(2, uid, 1, timeout=30)
data = m.register_window(np.zeros(64, np.uint8))
sig = m.signal_window(2)
src = m.register_window(np.ones(64, np.uint8))
m.barrier(timeout=30)
for i in range(1, rounds + 1):
    m.wait_signal(0, i, timeout=30, window=sig)
    m.put_signal(0, src, 0, data, 0, 8, 1, 1, signal_window=sig)
if how == "before-reply":  # its peer is then waiting for the next signal
    m.wait_signal(0, rounds + 1, timeout=30, window=sig)
os.kill(os.getpid(), signal.SIGKILL)
"""


def ping_pong_then_peer_dies(tmp_path, monkeypatch, how, then):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    prog = tmp_path / "dying_peer.py"
    prog.write_text(CHILD)
    uid = flagcx_mesh.get_unique_id()
    env = subprocess_env()
    env["FLAGCX_MESH_TRANSPORT"] = "tcp"
    child = subprocess.Popen([sys.executable, str(prog), uid.hex(), str(ROUNDS), how], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    m = None
    try:
        m = Mesh(2, uid, 0, timeout=30)
        data = m.register_window(np.zeros(64, np.uint8))
        sig = m.signal_window(2)
        src = m.register_window(np.ones(64, np.uint8))
        m.barrier(timeout=30)
        assert [p for p, _ in sig.paths][1] == "tcp", sig.describe()
        for i in range(1, ROUNDS + 1):
            m.put_signal(1, src, 0, data, 0, 8, 0, 1, signal_window=sig)
            m.wait_signal(1, i, timeout=30, window=sig)
        t0 = time.monotonic()
        with pytest.raises(PeerLost) as info:
            then(m, src, data, sig)
        elapsed = time.monotonic() - t0
        assert info.value.peer == 1 and "peer 1" in str(info.value), str(info.value)
        assert elapsed < 10, (elapsed, str(info.value))
        assert child.wait(30) == -9, child.stdout.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        if m is not None:
            m.close()


def test_a_waiter_in_wait_signal_fails_naming_the_peer_that_died(tmp_path, monkeypatch):
    ping_pong_then_peer_dies(tmp_path, monkeypatch, "after-reply",
                             lambda m, src, data, sig: m.wait_signal(1, ROUNDS + 1, timeout=20, window=sig))


def test_a_flush_fails_naming_the_peer_that_died_before_its_ack(tmp_path, monkeypatch):
    def then(m, src, data, sig):
        time.sleep(0.2)  # it is dead by now; the put's ack never comes
        for _ in range(100):
            m.put(1, src, 0, data, 0, 64)
            m.flush(1, timeout=20)

    ping_pong_then_peer_dies(tmp_path, monkeypatch, "after-reply", then)


def test_a_peer_that_dies_while_this_rank_waits_for_it(tmp_path, monkeypatch):
    """The child waits for one more signal, this rank sends it and waits for the answer: the
    child dies meanwhile (as soon as the signal arrived)."""
    def then(m, src, data, sig):
        m.put_signal(1, src, 0, data, 0, 8, 0, 1, signal_window=sig)
        m.wait_signal(1, ROUNDS + 1, timeout=20, window=sig)

    ping_pong_then_peer_dies(tmp_path, monkeypatch, "before-reply", then)
