"""Invariant 8 across processes (csrc/transport/binding.h): the host tests of test_peer_binding.py
run every agent in one process, so the process check always passes there. Here the peer agent
(a process of its own) hands over a THIRD process's real descriptor (its pid, cookie address and
seal, all valid in that process) relabelled as one of its own regions: the initiator must not
reach the third process's memory; cma is refused naming the peer and the field (pid), and the op
goes to the peer over tcp, which touches only its own regions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from descforge import Region
pytestmark = pytest.mark.timeout(120)
SECRET = "binding-procs-secret"
N = 4096
HERE = os.path.dirname(os.path.abspath(__file__))

THIRD = r"""
import sys, numpy as np
from flagcx_mesh.agent import Agent
a = Agent("third", sys.argv[1], timeout=10)
buf = np.full(int(sys.argv[2]), 0x5A, np.uint8)
r = a.register(buf)
print(r.descriptor.hex(), flush=True)
sys.stdin.readline()
print("INTACT" if (buf == 0x5A).all() else "CHANGED", flush=True)
sys.stdin.readline()
"""

PEER = r"""
import sys, numpy as np
from descforge import Region
from flagcx_mesh.agent import Agent
a = Agent("target", sys.argv[1], timeout=10)
own = np.zeros(int(sys.argv[2]), np.uint8)
r = Region.decode(a.register(own).descriptor)
print(a.metadata().hex(), flush=True)
third = Region.decode(bytes.fromhex(sys.stdin.readline().strip()))
forged = Region(r.agent, r.incarnation, r.index, r.size, r.kind, third.window)  # its own label, the third's window
print(forged.encode().hex(), flush=True)
sys.stdin.readline()
print("OWN", int(own.sum() // 0x77), flush=True)
sys.stdin.readline()
"""


INIT = r"""
import sys, numpy as np
from flagcx_mesh import MeshError
from flagcx_mesh.agent import Agent
meta, forged = (bytes.fromhex(x) for x in sys.stdin.readline().split())
with Agent("initiator", sys.argv[1], timeout=10) as a:
    conn = a.connect(meta, timeout=10)
    src = a.register(np.full(int(sys.argv[2]), 0x77, np.uint8))
    print("PATH", conn.path_to(forged), flush=True)
    try:
        conn.write(src, forged, int(sys.argv[2])).wait(10)
        print("WROTE", flush=True)
    except MeshError as e:
        print("REFUSED", type(e).__name__, str(e).replace("\n", " "), flush=True)
"""


def spawn(code, **env):
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}
    return subprocess.Popen([sys.executable, "-c", code, SECRET, str(N)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE if "FLAGCX_MESH_LOG" in env else None,
                            text=True, env=env)


def say(p, line=""):
    p.stdin.write(line + "\n")
    p.stdin.flush()


def test_a_third_processs_descriptor_handed_over_by_the_peer_reaches_nothing():
    third, peer = spawn(THIRD), spawn(PEER)
    init = None
    try:
        third_desc = third.stdout.readline().strip()
        meta = peer.stdout.readline().strip()
        say(peer, third_desc)
        forged = peer.stdout.readline().strip()
        w = Region.decode(bytes.fromhex(forged)).win()
        assert w.pid == third.pid and w.pid != peer.pid
        init = spawn(INIT, FLAGCX_MESH_TRANSPORT="cma", FLAGCX_MESH_LOG="info")
        out, err = init.communicate(meta + " " + forged + "\n", timeout=60)
        assert "PATH tcp" in out, (out, err)  # cma refused: the pid is not the peer's process
        assert "WROTE" in out or "agent target" in out, out
        reason = [line for line in err.splitlines() if "region #" in line and "over tcp" in line]
        assert reason and "field pid" in reason[0] and "the peer agent's process" in reason[0], err
        assert str(third.pid) in reason[0], reason
        say(third)
        assert third.stdout.readline().strip() == "INTACT"
        say(peer)
        assert peer.stdout.readline().split()[0] == "OWN"  # (over tcp: the peer's own region, its business)
    finally:
        for p in (third, peer):
            try:
                say(p)
            except (BrokenPipeError, OSError, ValueError):
                pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if init is not None and init.poll() is None:
            init.kill()
