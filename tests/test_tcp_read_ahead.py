"""The tcp engine reads each connection ahead, up to 8 KiB a recv (InConn::kReadAhead): several
small frames, or a frame and the head of the next, come in one read and are taken from there.
These check what that must keep: order and content across the buffer's edge, frames that
wait in it while reading pauses (a full mailbox) or while the waiter finds them, and puts
of every size next to messages."""

from __future__ import annotations

import time

import numpy as np
import pytest

import flagcx_mesh
from meshutil import close_all, run_threads

pytestmark = pytest.mark.timeout(120)

OP_TIMEOUT = 20.0


def tcp_meshes(monkeypatch, **kw):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    uid = flagcx_mesh.get_unique_id()
    return run_threads(2, lambda r: flagcx_mesh.Mesh(2, uid, r, timeout=30, **kw), timeout=45)


def payload(i, n):
    return bytes((i * 7 + k) % 256 for k in range(n))


def test_messages_and_puts_of_every_size_across_the_buffer_edge(monkeypatch):
    meshes = tcp_meshes(monkeypatch)
    sizes = [1, 7, 8, 9, 100, 4095, 4096, 8100, 8192, 8193, 9000, 20000, 70000, 3]
    try:
        def body(r):
            m = meshes[r]
            data = m.register_window(np.zeros(1 << 17, np.uint8))
            sig = m.signal_window(2)
            src = m.register_window(np.frombuffer(payload(5, 1 << 17), np.uint8).copy())
            m.barrier(timeout=30)
            if r == 0:
                for rnd in range(20):
                    for i, n in enumerate(sizes):
                        m.send(1, payload(rnd + i, n), timeout=OP_TIMEOUT)
                        m.put_signal(1, src, 0, data, 0, n, 0, 1, signal_window=sig)
                m.flush(timeout=OP_TIMEOUT)
            else:
                k = 0
                for rnd in range(20):
                    for i, n in enumerate(sizes):
                        assert m.recv(0, timeout=OP_TIMEOUT) == payload(rnd + i, n), (rnd, i, n)
                        k += 1
                        m.wait_signal(0, k, timeout=OP_TIMEOUT, window=sig)
                        assert bytes(np.frombuffer(data.buffer, np.uint8)[:n]) == payload(5, n)
            m.barrier(timeout=30)

        run_threads(2, body, timeout=100)
    finally:
        close_all(meshes)


def test_frames_read_ahead_while_the_mailbox_is_full_are_delivered(monkeypatch):
    """With a 1 KiB mailbox, reading pauses after the first messages while later ones sit read
    ahead; each recv resumes it, and every message arrives in order."""
    meshes = tcp_meshes(monkeypatch, max_unreceived=1024)
    try:
        def body(r):
            m = meshes[r]
            m.barrier(timeout=30)
            if r == 0:
                for i in range(300):
                    m.send(1, payload(i, 300), timeout=OP_TIMEOUT)
            else:
                time.sleep(0.3)  # the frames pile up (in the kernel and read ahead)
                for i in range(300):
                    assert m.recv(0, timeout=OP_TIMEOUT) == payload(i, 300), i
            m.barrier(timeout=30)

        run_threads(2, body, timeout=100)
    finally:
        close_all(meshes)
