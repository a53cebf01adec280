"""tcp lanes: several connections per (peer, context), large puts striped over them.

FLAGCX_MESH_TCP_LANES=4 with tcp forced. The mesh must report the lanes it uses (the smallest
offer of all ranks); a striped put lands byte for byte whatever its size; it keeps FIFO order
with the other ops of its (peer, context) (a later small put to the same bytes wins, a signal
after it sees all of it, even when its stripes overtake its first part); flush and
wait_counter count it once; a lane whose socket dies fails the pending ops with PeerLost
naming the peer, within the wait's timeout, and never applies the signal of a put cut short.
Every wait is bounded, and run_threads / the launcher bound each test as a whole.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections import Counter

import numpy as np
import pytest

import flagcx_mesh
from flagcx_mesh import InvalidArgument, PeerLost
from meshutil import PY, acked_since, bytes_acked, close_all, run_threads, stream_sockets, thread_meshes

pytestmark = pytest.mark.timeout(120)

HERE = os.path.dirname(os.path.abspath(__file__))
OP_TIMEOUT = 20.0
MIB = 1 << 20
STRIPE_MIN = MIB  # Engine::kStripeMinBytes: smaller puts stay on lane 0


@pytest.fixture
def lanes4(monkeypatch):
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    monkeypatch.setenv("FLAGCX_MESH_TCP_LANES", "4")
    meshes = thread_meshes(2, contexts=2)
    yield meshes
    close_all(meshes)


def pattern(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def lane_socket(mesh, peer, lane, ctx=0):
    """A socket object on (a duplicate of) this rank's send connection of that lane. Both ranks
    are threads of this process, and a socket of the other rank may have the same local port
    number (connected to another remote port): the lanes all go to the peer's one listening
    port, the remote port most of the candidates share, which tells them apart."""
    ports = mesh.tcp_lane_ports(peer, ctx)
    cands = []
    for s in stream_sockets():
        if s.getsockname()[1] in ports:
            cands.append(s)
        else:
            s.close()
    remote = Counter(s.getpeername()[1] for s in cands).most_common(1)[0][0] if cands else None
    chosen = None
    for s in cands:
        if chosen is None and s.getsockname()[1] == ports[lane] and s.getpeername()[1] == remote:
            chosen = s
        else:
            s.close()
    if chosen is None:
        raise AssertionError(f"no socket with local port {ports[lane]} to port {remote} (lane {lane})")
    return chosen


def test_finding_a_lane_socket_leaves_no_descriptor_behind(lanes4):
    """lane_socket duplicates every descriptor of the process to find the lane's: each duplicate
    that is not the socket kept is closed (those of descriptors that were no sockets were left
    open, doubling the process's other descriptors with each call: a CI worker ran out of its
    20000 after a few of these tests)."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        for k in range(4):
            lane_socket(lanes4[0], 1, k).close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_the_mesh_reports_the_lanes_the_variable_sets(lanes4):
    for m in lanes4:
        assert m.tcp_lanes == 4, m.describe()
        assert "tcp lanes 4" in m.describe()
        for ctx in (0, 1):
            ports = m.tcp_lane_ports(1 - m.rank, ctx)
            assert len(set(ports)) == 4 and min(ports) > 0, ports


def test_a_large_put_travels_over_every_lane(lanes4):
    """Each lane's connection carries about a quarter of a 16 MiB put (its kernel's count of
    acknowledged bytes), lane 0 no more than a quarter plus the remainder."""
    size = 16 * MIB

    def body(r):
        m = lanes4[r]
        dst = m.register_window(np.zeros(size, np.uint8))
        src = m.register_window(pattern(size, 1))
        m.barrier(timeout=30)
        if r == 0:
            socks = [lane_socket(m, 1, k) for k in range(4)]
            before = [bytes_acked(s) for s in socks]
            m.put(1, src, 0, dst, 0, size)
            m.flush(timeout=OP_TIMEOUT)
            sent = acked_since(socks, before, size // 4)
            for s in socks:
                s.close()
            assert all(size // 4 <= n <= size // 4 + 4096 for n in sent), sent
        m.barrier(timeout=30)
        if r == 1:
            assert np.array_equal(np.frombuffer(dst.buffer, np.uint8), pattern(size, 1))

    run_threads(2, body, timeout=60)


SIZES = [STRIPE_MIN - 1, STRIPE_MIN, STRIPE_MIN + 1, 3 * MIB + 1, 4 * MIB + 3, 7_777_777, 16 * MIB + 5]


@pytest.mark.parametrize("ctx", [0, 1])
def test_striped_puts_and_gets_of_many_sizes_land_byte_for_byte(lanes4, ctx):
    """Sizes around the striping threshold and not multiples of the lanes, at odd offsets; the
    target checks every byte and the zeros around them; then the initiator gets them back."""
    room = max(SIZES) + 64

    def body(r):
        m = lanes4[r]
        dst = m.register_window(np.zeros(room, np.uint8))
        src = m.register_window(pattern(room, 2))
        back = m.register_window(np.zeros(room, np.uint8))
        m.signal_window(2)
        m.barrier(timeout=30)
        for i, n in enumerate(SIZES):
            if r == 0:
                m.put_signal(1, src, 7, dst, 13, n, 0, 1, context=ctx)
                m.flush(timeout=OP_TIMEOUT)
            else:
                m.wait_signal(0, i + 1, timeout=OP_TIMEOUT)
                got = np.frombuffer(dst.buffer, np.uint8)
                assert np.array_equal(got[13:13 + n], pattern(room, 2)[7:7 + n]), n
                assert not got[:13].any() and not got[13 + n:].any(), n
                got[:] = 0
            m.barrier(timeout=30)
            if r == 0:
                m.get(1, src, 5, back, 3, n, context=ctx)
                m.flush(timeout=OP_TIMEOUT)
                b = np.frombuffer(back.buffer, np.uint8)
                assert np.array_equal(b[3:3 + n], pattern(room, 2)[5:5 + n]), n
                assert not b[:3].any() and not b[3 + n:].any(), n
                b[:] = 0
            m.barrier(timeout=30)

    run_threads(2, body, timeout=90)


def test_a_later_small_put_to_the_same_bytes_wins_and_the_signal_sees_both(lanes4):
    """A striped put of A over 8 MiB, then a small put of B into its middle (lane 0), then a
    signal: the waiter sees A everywhere but B's bytes. Stripes landing after the small put
    (lane 0 read on past the striped put) would leave A there."""
    size, at, small = 8 * MIB, 3 * MIB + 17, 4096

    def body(r):
        m = lanes4[r]
        dst = m.register_window(np.zeros(size, np.uint8))
        m.signal_window(2)
        srcs = [m.register_window(pattern(size, 10 + i)) for i in range(2)]
        m.barrier(timeout=30)
        for i in range(1, 6):
            a, b = srcs[i % 2], srcs[(i + 1) % 2]
            if r == 0:
                m.put(1, a, 0, dst, 0, size)
                m.put(1, b, at, dst, at, small)
                m.signal(1, 0, 1)
                m.flush(timeout=OP_TIMEOUT)
            else:
                m.wait_signal(0, i, timeout=OP_TIMEOUT)
                want = pattern(size, 10 + i % 2)
                want[at:at + small] = pattern(size, 10 + (i + 1) % 2)[at:at + small]
                assert np.array_equal(np.frombuffer(dst.buffer, np.uint8), want), i
            m.barrier(timeout=30)

    run_threads(2, body, timeout=90)


def test_stripes_that_overtake_their_first_part_wait_for_it(lanes4):
    """A 24 MiB message on lane 0 holds back a small put B (into the last quarter of the
    window) and the first part of the striped put_signal of A over the whole window queued
    after it, so A's stripes (lanes 1-3) arrive first. They must wait for B: the waiter sees A
    everywhere (stripes landed on arrival would be overwritten by the earlier B), and the
    message arrives whole."""
    size, msg_len, small = 6 * MIB + 3, 24 * MIB, 4096
    at = size - 2 * small

    def body(r):
        m = lanes4[r]
        dst = m.register_window(np.zeros(size, np.uint8))
        m.signal_window(2)
        a, b = (m.register_window(pattern(size, seed)) for seed in (20, 21))
        m.barrier(timeout=30)
        for i in range(1, 4):
            if r == 0:
                m.send(1, pattern(msg_len, i).tobytes())
                m.put(1, b, at, dst, at, small)
                m.put_signal(1, a, 0, dst, 0, size, 0, 1)
                m.flush(timeout=OP_TIMEOUT)
            else:
                m.wait_signal(0, i, timeout=OP_TIMEOUT)
                assert np.array_equal(np.frombuffer(dst.buffer, np.uint8), pattern(size, 20)), i
                assert m.recv(0, timeout=OP_TIMEOUT) == pattern(msg_len, i).tobytes()
                np.frombuffer(dst.buffer, np.uint8)[:] = 0
            m.barrier(timeout=30)

    run_threads(2, body, timeout=90)


def test_flush_and_wait_counter_count_a_striped_put_once(lanes4):
    size, n = 5 * MIB + 1, 6

    def body(r):
        m = lanes4[r]
        dst = m.register_window(np.zeros(size, np.uint8))
        src = m.register_window(pattern(size, 30))
        m.barrier(timeout=30)
        if r == 0:
            start = m.read_counter()
            for _ in range(n):
                m.put(1, src, 0, dst, 0, size, context=1)
            m.wait_counter(start + n, timeout=OP_TIMEOUT)
            m.flush(timeout=OP_TIMEOUT)
            assert m.read_counter() == start + n
        m.barrier(timeout=30)

    run_threads(2, body, timeout=60)


def test_a_waiter_that_goes_to_sleep_wakes_the_parked_progress_thread(monkeypatch):
    """Blocking striped puts, one after the other: flush reads lane 0 itself for its first
    50 us, so the progress thread often finds the read role taken and polls without lane 0.
    When the flush then sleeps, it must wake that poll (as it wakes a decided park); it was
    left to the poll's 1 ms timer, and such puts took ~1 ms more (1 in 30 here, 2 lanes).
    mesh.stats() counts parked polls and those that ran out their timer after a waiter slept."""
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    monkeypatch.setenv("FLAGCX_MESH_TCP_LANES", "2")
    meshes = thread_meshes(2)
    try:
        wins = run_threads(2, lambda r: meshes[r].register_window(np.full(STRIPE_MIN, r, np.uint8)), timeout=30)
        for _ in range(3000):
            meshes[0].put(1, wins[0], 0, wins[1], 0, STRIPE_MIN)
            meshes[0].flush(1, timeout=OP_TIMEOUT)
        stats = meshes[0].stats()
    finally:
        close_all(meshes)
    assert stats["progress_parks"] > 0, stats  # the waiters read: the case was there
    assert stats["progress_late_wakes"] == 0, stats


@pytest.mark.parametrize("lane", [0, 2])
def test_a_lane_killed_mid_op_fails_both_sides_with_peer_lost_naming_the_peer(lanes4, lane):
    """Rank 0 queues 256 MiB of striped puts and a put_signal, then one of its lanes' sockets is
    shut down. Its flush and rank 1's wait for that signal fail with PeerLost naming the other
    rank, well within their timeouts; the signal of the put cut short is never applied."""
    size, count = 32 * MIB, 8

    def body(r):
        m = lanes4[r]
        dst = m.register_window(np.zeros(size, np.uint8))
        m.signal_window(2)
        src = m.register_window(pattern(size, 40))
        m.barrier(timeout=30)
        if r == 0:
            sock = lane_socket(m, 1, lane)
            for _ in range(count - 1):
                m.put(1, src, 0, dst, 0, size)
            m.put_signal(1, src, 0, dst, 0, size, 0, 1)
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with pytest.raises(PeerLost) as e:
                m.flush(timeout=OP_TIMEOUT)
            assert "peer 1" in str(e.value), e.value
        else:
            with pytest.raises(PeerLost) as e:
                m.wait_signal(0, 1, timeout=OP_TIMEOUT)
            assert "peer 0" in str(e.value) or "rank 0" in str(e.value), e.value
            assert m.read_signal(0) == 0

    run_threads(2, body, timeout=60)


def test_the_default_fits_the_cores(monkeypatch):
    """Unset: min(4, max(1, cores / 2)) lanes (this suite's fd limit is far above the cap)."""
    import resource
    monkeypatch.delenv("FLAGCX_MESH_TCP_LANES", raising=False)
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    cores = os.sysconf("SC_NPROCESSORS_ONLN")
    want = min(4, max(1, cores // 2))
    assert soft == resource.RLIM_INFINITY or soft // 2 // 4 >= want
    meshes = thread_meshes(2)
    try:
        assert [m.tcp_lanes for m in meshes] == [want, want]
    finally:
        close_all(meshes)


def test_a_value_out_of_range_fails_the_build_naming_the_variable(monkeypatch):
    monkeypatch.setenv("FLAGCX_MESH_TCP_LANES", "17")
    uid = flagcx_mesh.get_unique_id()
    errs = run_threads(2, lambda r: flagcx_mesh.Mesh(2, uid, r, timeout=20), timeout=45, collect=True)
    for e in errs:
        if isinstance(e, flagcx_mesh.Mesh):
            e.close()
    assert any(isinstance(e, InvalidArgument) and "FLAGCX_MESH_TCP_LANES=17" in str(e) for e in errs), errs


MISMATCH_PROG = r"""
import os, sys
import numpy as np
os.environ["FLAGCX_MESH_TCP_LANES"] = sys.argv[1] if os.environ["FLAGCX_MESH_RANK"] == "0" else sys.argv[2]
from flagcx_mesh import Mesh
m = Mesh.from_launcher(timeout=30)
size = 3 * (1 << 20) + 1
dst = m.register_window(np.zeros(size, np.uint8))
m.signal_window(1)
src = m.register_window((np.arange(size) % 251).astype(np.uint8))
m.barrier(timeout=30)
if m.rank == 0:
    m.put_signal(1, src, 0, dst, 0, size, 0, 1)
    m.flush(timeout=20)
else:
    m.wait_signal(0, 1, timeout=20)
    assert np.array_equal(np.frombuffer(dst.buffer, np.uint8), (np.arange(size) % 251).astype(np.uint8))
print(f"LANES rank {m.rank}: {m.tcp_lanes} {len(m.tcp_lane_ports(1 - m.rank))}", flush=True)
m.barrier(timeout=30)
m.close()
"""


def test_mismatched_offers_take_the_smallest(tmp_path):
    prog = tmp_path / "lanes_mismatch_prog.py"
    prog.write_text(MISMATCH_PROG)
    env = dict(os.environ, FLAGCX_MESH_TRANSPORT="tcp")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), HERE) if p)
    p = subprocess.run([PY, "-m", "flagcx_mesh.launch", "-n", "2", "--timeout", "60", "--", PY, str(prog), "4", "2"],
                       env=env, cwd=HERE, capture_output=True, text=True, timeout=90)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    lines = sorted(ln[ln.index("LANES"):] for ln in out.splitlines() if "LANES" in ln)
    assert lines == ["LANES rank 0: 2 2", "LANES rank 1: 2 2"], out[-4000:]


LANES_PROG = os.path.join(HERE, "lanes_prog.py")


def run_pair(tmp_path, *flags, lanes=4, env_extra=None, timeout=90):
    """tests/lanes_prog.py as two processes (not under the launcher, which would stop the
    survivor when one dies); returns their RESULT dicts (None for a rank that printed none)
    and outputs."""
    import json
    from meshutil import finish_prog, spawn_prog, subprocess_env

    env = subprocess_env(dict(FLAGCX_MESH_TRANSPORT="tcp", FLAGCX_MESH_TCP_LANES=str(lanes), **(env_extra or {})))
    uid = tmp_path / "uid"
    procs = [spawn_prog(LANES_PROG, "--rank", r, "--uid-file", uid, "--lanes", lanes, *flags,
                        *(["--make-uid"] if r == 0 else []), env=env, cwd=HERE) for r in (0, 1)]
    results, outs = [], []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            pytest.fail(f"rank did not finish in {timeout} s (a hang):\n{out[-3000:]}\n{err[-3000:]}")
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        results.append(json.loads(lines[-1][len("RESULT "):]) if lines else None)
        outs.append((p.returncode, out[-3000:] + err[-3000:]))
    return results, outs


@pytest.mark.parametrize("victim", ["initiator", "target"])
def test_a_peer_killed_mid_striped_put_fails_the_other_with_peer_lost_naming_it(tmp_path, victim):
    """Rank 0 queues 8 striped puts of 32 MiB (the last a put_signal) over 4 lanes; the
    initiator is SIGKILLed right after queuing them, or the target once their first bytes
    landed. The survivor's wait (rank 1's wait_signal, rank 0's flush) fails with PeerLost
    naming the dead rank within its timeout, and rank 1 never sees the signal of puts cut short."""
    flag = "--die-after-queue" if victim == "initiator" else "--die-on-bytes"
    results, outs = run_pair(tmp_path, flag, "--size", 32 * MIB, "--op-timeout", OP_TIMEOUT)
    dead, alive = (0, 1) if victim == "initiator" else (1, 0)
    assert outs[dead][0] == -9, outs[dead]
    r = results[alive]
    assert r is not None, outs[alive]
    assert not r["ok"] and r["type"] == "PeerLost", r
    assert r["peer"] == dead and f"peer {dead}" in r["message"], r
    if alive == 1:
        assert r["signal"] == 0, r
