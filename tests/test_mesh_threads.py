"""Ranks as threads in one process (the constructor releases the GIL while it blocks)."""

import math
import os
import threading
import time

import pytest

import flagcx_mesh
from flagcx_mesh import InvalidArgument, Mesh, MeshClosed, MeshError, MeshTimeout, PeerLost
from meshutil import raise_nofile_limit, run_threads

pytestmark = pytest.mark.timeout(90)

BUILD_TIMEOUT = 30.0
PHASES = ("listen", "rendezvous", "connect", "wiring")


@pytest.fixture(autouse=True, scope="module")
def _nofile():
    raise_nofile_limit()


def tag(mesh_id, src, dst, ctx, seq=0):
    return f"{mesh_id}|{src}->{dst}|ctx{ctx}|#{seq}|".encode() + bytes([src % 256, dst % 256]) * 8


def build_all(n, contexts=1, timeout=BUILD_TIMEOUT, **kw):
    """Build an n-rank mesh from n threads; returns the meshes in rank order."""
    uid = flagcx_mesh.get_unique_id()
    return run_threads(n, lambda r: Mesh(n, uid, r, contexts=contexts, timeout=timeout, **kw),
                       timeout=timeout + 15)


def close_all(meshes):
    for m in meshes:
        if isinstance(m, Mesh):
            m.close()


def exchange(meshes, seq=0):
    """Every rank sends a tagged message on every (peer, context), self included, then
    receives them all and checks the tags."""
    n, contexts = len(meshes), meshes[0].contexts

    def body(r):
        m = meshes[r]
        for p in range(n):
            for c in range(contexts):
                m.send(p, tag(m.mesh_id, r, p, c, seq), c)
        for p in range(n):
            for c in range(contexts):
                got = m.recv(p, c, timeout=10)
                assert got == tag(m.mesh_id, p, r, c, seq), (r, p, c, got[:60])
        return True

    assert run_threads(n, body, timeout=60) == [True] * n


# ----------------------------------------------------------------------------- build and use

@pytest.mark.parametrize("n, contexts", [(1, 1), (2, 1), (3, 1), (4, 1), (8, 1), (16, 1), (32, 1),
                                         (4, 3), (8, 2)])
def test_build_exchange_collectives(n, contexts):
    meshes = build_all(n, contexts)
    try:
        ids = {m.mesh_id for m in meshes}
        assert len(ids) == 1 and len(ids.pop()) == 32
        for r, m in enumerate(meshes):
            assert (m.rank, m.nranks, m.contexts, m.closed) == (r, n, contexts, False)
            assert f"rank {r} of {n}" in m.describe()
        exchange(meshes, seq=0)
        exchange(meshes, seq=1)  # connections stay usable, FIFO per (peer, ctx)

        def collectives(r):
            m = meshes[r]
            m.barrier(timeout=20)
            got = m.allgather(b"rank-%d" % r * (r + 1), timeout=20)
            empty = m.allgather(b"", timeout=20)
            m.barrier(timeout=20)
            return got, empty

        for got, empty in run_threads(n, collectives, timeout=60):
            assert got == [b"rank-%d" % k * (k + 1) for k in range(n)]
            assert empty == [b""] * n

        for m in meshes:
            t = m.timings()
            assert set(t) == {"listen", "rendezvous", "connect", "wiring", "total"}
            assert all(isinstance(v, float) and v >= 0 for v in t.values()), t
            parts = t["listen"] + t["rendezvous"] + t["connect"] + t["wiring"]
            assert t["total"] >= max(t["listen"], t["rendezvous"], t["connect"], t["wiring"])
            assert abs(t["total"] - parts) < 0.01 + 0.01 * t["total"], t
            assert t["total"] < BUILD_TIMEOUT
            s = m.stats()
            assert set(s) == {"rejected", "rejected_total", "connect_retries", "accept_fd_exhausted",
                              "staged_bytes_peak", "progress_parks", "progress_late_wakes", "tcp_early_admits", "tcp_admit_limit_waits",
                              "get_answer_bytes_held", "get_answer_bytes_peak"}
            assert s["rejected"] == {} and s["rejected_total"] == 0, s  # nothing foreign here
            assert isinstance(s["connect_retries"], int) and s["connect_retries"] >= 0
            assert s["accept_fd_exhausted"] == 0, s  # descriptors to spare here
            assert all(isinstance(s[k], int) and s[k] >= 0 for k in ("progress_parks", "progress_late_wakes",
                                                                  "tcp_early_admits", "tcp_admit_limit_waits")), s
    finally:
        close_all(meshes)
    assert all(m.closed for m in meshes)


def test_phase_hook_order_and_thread():
    n = 3
    uid = flagcx_mesh.get_unique_id()
    seen = {r: [] for r in range(n)}

    def body(r):
        me = threading.get_ident()

        def hook(phase):
            assert threading.get_ident() == me  # called from the building thread
            seen[r].append(phase)

        with Mesh(n, uid, r, timeout=BUILD_TIMEOUT, _on_phase=hook) as m:
            m.barrier(timeout=10)
        return m

    meshes = run_threads(n, body, timeout=45)
    assert all(seen[r] == list(PHASES) for r in range(n)), seen
    assert all(m.closed for m in meshes)


def test_large_message_and_buffer_protocol():
    meshes = build_all(2)
    try:
        big = bytes(range(256)) * (4 << 10)  # 1 MiB: needs a concurrent receiver

        def body(r):
            m = meshes[r]
            peer = 1 - r
            if r == 0:
                m.send(peer, big)
                m.send(peer, memoryview(bytearray(b"view")))
                m.send(peer, b"")
                return None
            return [m.recv(peer, timeout=20) for _ in range(3)]

        _, got = run_threads(2, body, timeout=45)
        assert got[0] == big and got[1] == b"view" and got[2] == b""
    finally:
        close_all(meshes)


# ----------------------------------------------------------------------------- lifetime

def test_close_idempotent_context_manager_and_use_after_close():
    n = 2
    uid = flagcx_mesh.get_unique_id()

    def body(r):
        with Mesh(n, uid, r, timeout=BUILD_TIMEOUT) as m:
            m.barrier(timeout=10)
        return m

    meshes = run_threads(n, body, timeout=45)
    for m in meshes:
        assert m.closed
        m.close()  # idempotent
        m.close()
        assert m.closed and "closed" in m.describe()
        with pytest.raises(MeshClosed, match="closed") as info:
            m.send(0, b"x")
        assert info.value.code == flagcx_mesh.errors.CLOSED
        with pytest.raises(MeshClosed):
            m.recv(0, timeout=1)
        with pytest.raises(MeshClosed):
            m.allgather(b"x", timeout=1)
        with pytest.raises(MeshClosed):
            m.barrier(timeout=1)
        # identity and build information stay readable after close
        assert m.rank in (0, 1) and m.nranks == n
        assert set(m.timings()) >= {"total"} and "rejected_total" in m.stats()


def test_close_wakes_a_blocked_recv():
    meshes = build_all(2)
    m = meshes[0]
    result = {}

    def blocked():
        t0 = time.monotonic()
        try:
            m.recv(1, timeout=None)
        except BaseException as e:  # noqa: BLE001
            result["exc"] = e
        result["secs"] = time.monotonic() - t0

    t = threading.Thread(target=blocked, daemon=True)
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "recv returned with nothing sent"
    t0 = time.monotonic()
    m.close()
    t.join(10)
    assert not t.is_alive(), "close() did not wake the blocked recv"
    assert time.monotonic() - t0 < 5
    assert isinstance(result.get("exc"), MeshClosed), result
    meshes[1].close()


def test_exception_closes_via_context_manager():
    n = 2
    uid = flagcx_mesh.get_unique_id()

    def body(r):
        holder = {}
        with pytest.raises(KeyError):
            with Mesh(n, uid, r, timeout=BUILD_TIMEOUT) as m:
                holder["m"] = m
                raise KeyError("inside")
        return holder["m"].closed

    assert run_threads(n, body, timeout=45) == [True, True]


# ----------------------------------------------------------------------------- bad input

def test_bad_peer_and_context_raise_invalid_argument():
    meshes = build_all(2, contexts=2)
    try:
        m = meshes[0]
        for peer in (-1, 2, 1000):
            with pytest.raises(InvalidArgument, match=f"peer {peer} is out of range") as info:
                m.send(peer, b"x")
            assert info.value.peer == peer
            with pytest.raises(InvalidArgument, match=f"peer {peer} is out of range"):
                m.recv(peer, timeout=1)
        for ctx in (-1, 2, 99):
            with pytest.raises(InvalidArgument, match=f"context {ctx} is out of range"):
                m.send(1, b"x", context=ctx)
            with pytest.raises(InvalidArgument, match=f"context {ctx} is out of range"):
                m.recv(1, context=ctx, timeout=1)
        with pytest.raises(ValueError):
            m.recv(1, timeout=-1)
        with pytest.raises(InvalidArgument, match="send: data must be bytes-like"):
            m.send(1, 12345)  # not a buffer
        # nothing bad reached the peer: the next real message is the first one it sees
        m.send(1, b"after", context=1)
        assert meshes[1].recv(0, context=1, timeout=5) == b"after"
    finally:
        close_all(meshes)


@pytest.mark.parametrize("args, kw, match", [
    ((2, None, 2), {}, "rank 2 is out of range for nranks=2"),
    ((2, None, -1), {}, "rank -1 is out of range"),
    ((0, None, 0), {}, "nranks must be >= 1"),
    ((-3, None, 0), {}, "nranks must be >= 1"),
    ((2, None, 0), {"contexts": 0}, "contexts must be in"),
    ((2, None, 0), {"contexts": 1025}, "contexts must be in"),
    ((2, None, 0), {"max_inflight": 0}, "max_inflight"),
    ((2, b"\0" * 255, 0), {}, "unique id must be 256 bytes, got 255"),
    ((2, b"", 0), {}, "unique id must be 256 bytes, got 0"),
    ((2, b"\0" * 256, 0), {}, "bad magic"),
])
def test_bad_constructor_args(args, kw, match):
    n, uid, rank = args
    uid = flagcx_mesh.get_unique_id() if uid is None else uid
    t0 = time.monotonic()
    with pytest.raises(InvalidArgument, match=match):
        Mesh(n, uid, rank, timeout=5, **kw)
    assert time.monotonic() - t0 < 2, "argument errors must be immediate"


def test_bad_timeout_is_value_error():
    uid = flagcx_mesh.get_unique_id()
    for t in (-1, math.nan):
        with pytest.raises(ValueError, match="timeout"):
            Mesh(1, uid, 0, timeout=t)


# ----------------------------------------------------------------------------- timeouts and failures

def test_recv_timeout_names_the_peer():
    meshes = build_all(3, contexts=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(MeshTimeout, match=r"peer 2.*ctx 1.*timed out") as info:
            meshes[0].recv(2, context=1, timeout=0.3)
        assert 0.25 <= time.monotonic() - t0 < 3
        assert info.value.peer == 2 and info.value.code == flagcx_mesh.errors.TIMEOUT
        assert isinstance(info.value, TimeoutError)
        # a timed-out recv (no bytes consumed) leaves the connection usable
        meshes[2].send(0, b"late", context=1)
        assert meshes[0].recv(2, context=1, timeout=5) == b"late"
    finally:
        close_all(meshes)


def test_collective_timeout_when_a_rank_does_not_join():
    meshes = build_all(2)
    try:
        t0 = time.monotonic()
        with pytest.raises(MeshTimeout):
            meshes[0].barrier(timeout=0.3)
        assert time.monotonic() - t0 < 3
    finally:
        close_all(meshes)


def test_hook_exception_aborts_every_rank():
    """A rank that fails after joining the rendezvous makes every other rank fail fast
    with PeerLost naming it; the failing rank gets its own exception back."""
    n = 4
    uid = flagcx_mesh.get_unique_id()

    class Boom(Exception):
        pass

    def body(r):
        def hook(phase):
            if r == 1 and phase == "rendezvous":
                raise Boom("injected failure of rank 1")

        t0 = time.monotonic()
        try:
            Mesh(n, uid, r, timeout=20, _on_phase=hook)
        except BaseException as e:  # noqa: BLE001
            return e, time.monotonic() - t0
        return None, time.monotonic() - t0

    out = run_threads(n, body, timeout=40)
    assert isinstance(out[1][0], Boom), out[1]
    for r in (0, 2, 3):
        exc, secs = out[r]
        assert isinstance(exc, PeerLost), (r, exc)
        assert exc.peer == 1 and "rank 1" in str(exc), str(exc)
        assert str(exc).startswith(f"rank {r}: "), str(exc)
        assert secs < 10, f"rank {r} took {secs:.1f} s to notice"


def test_build_timeout_when_ranks_are_missing():
    n = 3
    uid = flagcx_mesh.get_unique_id()

    def body(r):
        t0 = time.monotonic()
        with pytest.raises(MeshError) as info:
            Mesh(n, uid, r, timeout=1.0)
        return info.value, time.monotonic() - t0

    out = run_threads(1, body, timeout=20)  # only rank 0 of 3 shows up
    exc, secs = out[0]
    assert isinstance(exc, MeshTimeout), exc
    assert 0.5 <= secs <= 1.5, secs  # fails by its deadline, not long after
    assert str(exc).startswith("rank 0: ")
    assert "ranks [1, 2]" in str(exc) and "never joined" in str(exc), str(exc)
    assert exc.peer == 1, exc.peer


def test_collective_after_a_timed_out_one_never_returns_stale_data():
    meshes = build_all(2)
    timed_out, rank1_done = threading.Event(), threading.Event()
    try:
        def body(r):
            m = meshes[r]
            if r == 0:
                with pytest.raises(MeshTimeout):
                    m.barrier(timeout=0.2)  # rank 1 is not there yet
                timed_out.set()
                assert rank1_done.wait(10)
            else:
                assert timed_out.wait(10)
                # rank 1's barrier completes with rank 0's timed-out contribution
                m.barrier(timeout=3)
                rank1_done.set()
                return None
            try:
                return m.allgather(b"mine-0", timeout=3)
            except MeshError as e:
                return e

        got = run_threads(2, body, timeout=30)
        # rank 0 must get its own new contribution back, or an error: never stale data
        assert isinstance(got[0], MeshError) or got[0][0] == b"mine-0", got
    finally:
        close_all(meshes)


def thread_names() -> list:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


def test_the_library_threads_carry_names(monkeypatch):
    """What `top -H`, `ps -L` and a debugger show: a mesh's progress thread and tcp lane workers,
    an agent's listener, each named (fxm-...), so that a stalled process's threads can be told
    apart from the application's."""
    from flagcx_mesh.agent import Agent

    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    monkeypatch.setenv("FLAGCX_MESH_TCP_LANES", "2")
    meshes = build_all(2)
    agent = Agent("named-threads", "s")
    try:
        deadline = time.monotonic() + 10  # each thread names itself as it starts
        while True:
            names = thread_names()
            if names.count("fxm-progress") >= 2 and {"fxm-lane", "fxm-listen"} <= set(names):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert names.count("fxm-progress") >= 2, names
        assert "fxm-lane" in names, names
        assert "fxm-listen" in names, names
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            assert not f.read().startswith("fxm-")  # named inside each new thread, not the caller
    finally:
        agent.close()
        close_all(meshes)
