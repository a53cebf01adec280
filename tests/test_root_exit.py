"""The bootstrap root lives in the process that made the unique id (issue 9, item 8).

That process may finish first (rank 0 under torchrun, MPI or a plain environment, and
rank 0 of every later mesh in the selftest): its exit must not take the root away from
ranks that joined and still use it. At exit it waits, up to the ranks' build timeout,
until each of them has left the root, and names those it gave up on.
"""

import subprocess
import sys
import time

import pytest

from meshutil import PY, REPO_ROOT, run_threads, subprocess_env

import flagcx_mesh
from flagcx_mesh import errors

pytestmark = pytest.mark.timeout(120)

MESSAGES = 512          # relayed messages from rank 0 to rank 1 ...
MESSAGE_BYTES = 65536   # ... of the largest relayed size: 32 MiB, far above socket buffers

# Rank 0: makes the unique id (so it hosts the root), relays MESSAGES to rank 1, which
# reads none of them yet, then closes and returns from the program.
HOST = f"""
import sys
from flagcx_mesh import get_unique_id
from flagcx_mesh.netbuild import NetBootstrap
uid = get_unique_id()
print("UID", uid.hex(), flush=True)
boot = NetBootstrap(2, uid, 0, float(sys.argv[1]))
sys.stdin.readline()  # rank 1 has joined
for i in range({MESSAGES}):
    boot.send(1, 7, bytes([i % 251]) * {MESSAGE_BYTES}, 30.0)
boot.close()
print("EXITING", flush=True)
"""

# Rank 1: joins, waits for "go" on stdin, then receives and checks every message.
PEER = f"""
import sys
from flagcx_mesh.netbuild import NetBootstrap
boot = NetBootstrap(2, bytes.fromhex(sys.argv[1]), 1, float(sys.argv[2]))
print("JOINED", flush=True)
sys.stdin.readline()
got = 0
try:
    for i in range({MESSAGES}):
        m = boot.recv(0, 7, 30.0)
        assert m == bytes([i % 251]) * {MESSAGE_BYTES}, f"message {{i}} is wrong"
        got += 1
finally:
    print("GOT", got, flush=True)
boot.close()
"""


def _start(code, *args):
    return subprocess.Popen([PY, "-c", code, *map(str, args)], env=subprocess_env(), cwd=REPO_ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _expect_line(proc, prefix):
    line = proc.stdout.readline()
    assert line.startswith(prefix), (prefix, line, proc.stderr.read() if proc.poll() is not None else "")
    return line.split()


def _tell(proc):
    proc.stdin.write("\n")
    proc.stdin.flush()


def _stop(*procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def test_host_exit_waits_until_joined_ranks_have_left():
    """32 MiB relayed by rank 0 sit at the root when rank 0's program ends: rank 1 still gets
    every byte. Before the fix the root died with the process and rank 1 got a few MiB, then
    PeerLost "lost the bootstrap root"."""
    host = _start(HOST, 60)
    peer = None
    try:
        uid = _expect_line(host, "UID")[1]
        peer = _start(PEER, uid, 60)
        _expect_line(peer, "JOINED")
        _tell(host)
        _expect_line(host, "EXITING")
        try:  # give an exiting host the time to be gone before rank 1 starts reading
            host.wait(timeout=3)
        except subprocess.TimeoutExpired:
            pass  # still waiting for rank 1, as it should
        _tell(peer)
        out, err = peer.communicate(timeout=90)
        assert f"GOT {MESSAGES}" in out, out + err
        assert peer.returncode == 0, out + err
        hout, herr = host.communicate(timeout=30)
        assert host.returncode == 0, hout + herr
        assert "gave up" not in herr, herr
    finally:
        _stop(*(p for p in (host, peer) if p is not None))


def test_host_exit_wait_is_bounded_and_names_the_ranks_still_connected():
    """A joined rank that never leaves holds the exit up to the ranks' build timeout (3 s
    here), no longer; the host then says which ranks were still connected."""
    host = _start(HOST.replace(f"range({MESSAGES})", "range(1)"), 3)
    peer = None
    try:
        uid = _expect_line(host, "UID")[1]
        peer = _start(PEER, uid, 3)  # joins, then waits on stdin for ever
        _expect_line(peer, "JOINED")
        _tell(host)
        _expect_line(host, "EXITING")
        out, err = host.communicate(timeout=60)
        assert host.returncode == 0, out + err
        assert "still connected" in err and "[1]" in err, err
    finally:
        _stop(*(p for p in (host, peer) if p is not None))


def test_collective_after_a_rank_left_fails_at_once_naming_it():
    """Rank 0 closed its mesh; rank 1's barrier cannot complete: it fails naming rank 0
    instead of waiting out its timeout (rank 0's exit would wait as long for it)."""
    uid = flagcx_mesh.get_unique_id()
    meshes = run_threads(2, lambda r: flagcx_mesh.Mesh(2, uid, r, timeout=30), timeout=60)
    meshes[0].close()
    t0 = time.monotonic()
    with pytest.raises(errors.PeerLost) as info:
        meshes[1].barrier(timeout=20)
    assert info.value.peer == 0, str(info.value)
    assert "rank 0 left" in str(info.value), str(info.value)
    meshes[1].close()
    print(f"barrier failed after {time.monotonic() - t0:.3f} s: {info.value}", file=sys.stderr)
