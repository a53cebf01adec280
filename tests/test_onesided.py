"""One-sided windows and operations over every transport, ranks as processes and threads.

Ranks as processes: every scenario of tests/onesided_prog.py (integrity, ordering, threads,
bad_input, timeout, peer_death) runs under the embedded launcher over every forced transport
(FLAGCX_MESH_TRANSPORT=tcp|cma|shm, auto where it differs) at 2 and 4 ranks (integrity also at
8 over tcp); the job must exit 0 with every rank reporting OK, and rank 0's window modes must
match the forced transport. Quick API checks run with ranks as threads in this process.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import textwrap
import threading
import time

import numpy as np
import pytest

import flagcx_mesh
from flagcx_mesh import InvalidArgument, Mesh, MeshClosed, MeshTimeout, PeerLost
from meshutil import PY, run_threads, subprocess_env, close_all, thread_meshes

pytestmark = pytest.mark.timeout(150)

HERE = os.path.dirname(os.path.abspath(__file__))  # cwd of the jobs: no package shadows the tested one
PROG = os.path.join(HERE, "onesided_prog.py")
TRANSPORTS = ("tcp", "cma", "shm")
LAUNCH_TIMEOUT = 90  # the launcher's wall-clock limit for one job
MODES = {  # FLAGCX_MESH_TRANSPORT -> the modes of a user, an alloc and a signal window
    "tcp": {"user": "tcp", "alloc": "tcp", "signal": "tcp"},
    "cma": {"user": "cma", "alloc": "cma", "signal": "shm"},
    "shm": {"user": "cma", "alloc": "shm", "signal": "shm"},
    "auto": {"user": "cma", "alloc": "shm", "signal": "shm"},
}


def run_job(scenario: str, n: int, transport: str, *args: str, silent=()):
    """Run onesided_prog.py SCENARIO as an n-rank launcher job (FLAGCX_MESH_TRANSPORT=transport);
    asserts exit 0 and an OK line from every rank not in `silent`; returns the CompletedProcess."""
    cmd = [PY, "-m", "flagcx_mesh.launch", "-n", str(n), "--timeout", str(LAUNCH_TIMEOUT), "--grace", "1",
           "--", PY, PROG, scenario, "--deadline", str(LAUNCH_TIMEOUT - 10), *args]
    env = subprocess_env()
    env.pop("FLAGCX_MESH_TRANSPORT", None)
    if transport != "auto":
        env["FLAGCX_MESH_TRANSPORT"] = transport
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True,
                           timeout=LAUNCH_TIMEOUT + 30)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{scenario} x{n} over {transport}: the job hung past {LAUNCH_TIMEOUT + 30} s\n"
                    f"{e.stdout}\n{e.stderr}")
    took = time.monotonic() - t0
    assert p.returncode == 0, (f"{scenario} x{n} over {transport}: launcher exit {p.returncode} after "
                               f"{took:.1f} s\n--- stdout\n{p.stdout[-6000:]}\n--- stderr\n{p.stderr[-8000:]}")
    for r in range(n):
        if r not in silent:
            assert re.search(rf"OK rank {r} {scenario} \({transport}\)", p.stdout), \
                f"rank {r} did not report OK\n{p.stdout[-4000:]}"
    return p


def check_modes(p, transport: str) -> None:
    """Rank 0's window modes match the forced transport (cma falls back to tcp, saying so,
    where the kernel refuses cross-memory attach)."""
    m = re.search(r"\[rank 0\] modes user=(\S+) alloc=(\S+) signal=(\S+)(.*)", p.stdout)
    assert m, f"rank 0 printed no modes line\n{p.stdout[-3000:]}"
    want = dict(MODES[transport])
    if "cma refused" in m.group(4):
        want = {k: "tcp" if v == "cma" else v for k, v in want.items()}
    assert dict(zip(("user", "alloc", "signal"), m.groups()[:3])) == want, m.group(0)


def matrix(extra=()):
    return [pytest.param(t, n, id=f"{t}-{n}") for t in TRANSPORTS for n in (2, 4)] + \
        [pytest.param(t, n, id=f"{t}-{n}") for t, n in extra]


# ----------------------------------------------------------------------------- ranks as processes

@pytest.mark.parametrize("transport,n", matrix(extra=[("auto", 2), ("tcp", 8)]))
def test_integrity_random_puts_and_gets(transport, n):
    """Random contents at random offsets and sizes (0, 1, unaligned, end-aligned, whole window),
    put / batch_put / put_signal(value 0) / get, user and library windows on both sides, to
    every peer and self; every destination window is checked byte for byte after each phase."""
    p = run_job("integrity", n, transport, "--ops", "24" if n < 8 else "12")
    check_modes(p, transport)


@pytest.mark.parametrize("transport,n", matrix(extra=[("auto", 2)]))
def test_ordering_signal_never_before_data(transport, n):
    """2000 (1000 at 4 ranks) put_signal of 64 KiB with a sequence pattern: whenever the target
    reads signal value v, the first v chunks are complete; a size-0 signal does not overtake
    plain puts / batch_put; value 0 = data only; op='set'."""
    p = run_job("ordering", n, transport, "--count", "2000" if n == 2 else "1000")
    check_modes(p, transport)


@pytest.mark.parametrize("transport,n", matrix())
def test_threads_concurrent_puts(transport, n):
    """4 threads per rank on 2 contexts: puts, gets and put_signals to every peer at once,
    flush from every thread; contents, signal slots and the completion counter are exact."""
    p = run_job("threads", n, transport)
    check_modes(p, transport)


@pytest.mark.parametrize("transport,n", matrix())
def test_bad_input_refused_and_nothing_written(transport, n):
    """Every bad input of item 4 raises InvalidArgument / MeshClosed naming what is wrong, the
    completion counter does not move, and every window of every rank is unchanged."""
    p = run_job("bad_input", n, transport)
    check_modes(p, transport)
    refused = [int(x) for x in re.findall(r"bad_input: (\d+) bad calls refused", p.stdout)]
    assert len(refused) == n and min(refused) > 100, refused


@pytest.mark.parametrize("transport,n", matrix())
def test_wait_signal_timeout_names_slot_values_and_signaller(transport, n):
    """wait_signal(timeout=0.5) on a slot nobody signals raises MeshTimeout within 2 s naming the
    slot, expected / current values and "never signalled"; after a set / add from a known rank,
    "last signalled by rank X" with .peer == X; wait_counter times out too."""
    p = run_job("timeout", n, transport)
    check_modes(p, transport)


@pytest.mark.parametrize("transport,n", matrix())
def test_peer_death_fails_pending_ops_naming_it(transport, n):
    """Rank 1 is SIGKILLed (no goodbye) with 16 MiB of puts and a get queued to it: flush,
    wait_signal and wait_counter raise PeerLost naming rank 1 within seconds, not at their
    timeouts; the survivors still reach each other and close promptly."""
    # over tcp also: no CPU burnt by the survivors' progress threads once the peer is lost
    cpu = ("--check-cpu",) if transport == "tcp" else ()
    p = run_job("peer_death", n, transport, *cpu, silent=(1,))  # rank 1 is killed
    check_modes(p, transport)
    assert "killed by signal 9" in p.stdout, p.stdout[-3000:]
    if transport == "tcp":
        lost = re.findall(r"flush after 17 ops to rank 1, [\d.]+ s after the kill: PeerLost: (.*)", p.stdout)
        assert len(lost) == n - 1 and all("peer 1" in m for m in lost), p.stdout[-3000:]


# ----------------------------------------------------------------------------- ranks as threads

def test_threads_api_roundtrip():
    """2 ranks as threads: windows, put_signal / wait_signal, get, batch_put, signal set/add,
    counters, mode / paths / describe / buffer."""
    meshes = thread_meshes(2)

    def body(r):
        m = meshes[r]
        peer = 1 - r
        arr = ((np.arange(4096 + r) * (r + 3)) % 251).astype(np.uint8)
        mine = arr.copy()
        U = m.register_window(arr)
        A = m.alloc_window(8192)
        S = m.signal_window(4)
        assert (U.index, A.index, S.index) == (0, 1, 2)
        assert (U.kind, A.kind, S.kind) == ("user", "shm", "signal")
        assert U.size == len(arr) and A.size == 8192 and S.nslots == 4
        assert isinstance(A.buffer, memoryview) and len(A.buffer) == 8192 and not A.buffer.readonly
        assert bytes(A.buffer) == bytes(8192)  # zero-filled
        m.barrier(timeout=10)  # nobody writes before everyone has looked
        for w in (U, A, S):
            assert w.mode in ("shm", "cma", "tcp") and len(w.paths) == 2 and w.paths[r][0] == "self"
            assert f"window #{w.index}" in w.describe() and f"mode {w.mode}" in w.describe()
            assert f"mode={w.mode}" in repr(w)
        c0 = m.read_counter()
        m.put_signal(peer, U, 10, A, 100, 1000, slot=0)  # data then signal
        m.wait_signal(0, 1, timeout=10)
        other = (np.arange(4096 + peer) * (peer + 3)) % 251
        assert bytes(A.buffer[100:1100]) == bytes(other[10:1010].astype(np.uint8))
        m.signal(peer, 1, 7, op="set")
        m.signal(peer, 1, 2)  # add
        m.batch_put(peer, U, A, [(0, 0, 10), (4000, 5000, 96), (0, 8192, 0)])
        m.signal(peer, 2)
        m.wait_signal(2, 1, timeout=10)
        assert m.read_signal(1) == 9 and S.read(1) == 9
        assert bytes(A.buffer[5000:5096]) == bytes(other[4000:4096].astype(np.uint8))
        scratch = np.zeros(64, np.uint8)
        G = m.register_window(scratch)
        m.get(peer, A, 100, G, 0, 64)
        m.flush(peer, timeout=10)
        assert bytes(scratch) == bytes(mine[10:74])  # the peer's A holds what this rank put
        m.wait_counter(c0 + 8, timeout=10)
        assert m.read_counter() - c0 == 8  # 1 put_signal, 2 signals, 3 batch entries, 1 signal, 1 get
        m.barrier(timeout=10)
        for w in (G, U, A, S):
            w.close()
        assert U.closed
        with pytest.raises(InvalidArgument, match="deregistered"):
            m.put(peer, U, 0, A, 0, 1)
        return True

    try:
        assert run_threads(2, body, timeout=60) == [True, True]
    finally:
        close_all(meshes)


def test_threads_wait_signal_wakes_on_signal_from_another_thread():
    """A rank blocked in wait_signal (GIL released) returns when a peer signals; the timeout
    error names the slot and the last signaller."""
    meshes = thread_meshes(2)
    try:
        sigs = run_threads(2, lambda r: meshes[r].signal_window(2), timeout=30)
        t0 = time.monotonic()
        timer = threading.Timer(0.3, lambda: meshes[1].signal(0, 1, 5))
        timer.start()
        meshes[0].wait_signal(1, 5, timeout=10)
        assert 0.2 < time.monotonic() - t0 < 5
        with pytest.raises(MeshTimeout, match=r"slot 1\): expected >= 6, current 5, last signalled by rank 1"):
            meshes[0].wait_signal(1, 6, timeout=0.3)
        run_threads(2, lambda r: sigs[r].close(), timeout=30)
    finally:
        close_all(meshes)


def test_threads_forced_tcp_modes(monkeypatch):
    """FLAGCX_MESH_TRANSPORT is read at registration: tcp for every window and path, saying why."""
    meshes = thread_meshes(2)
    try:
        monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")

        def body(r):
            m = meshes[r]
            U = m.register_window(np.zeros(64, np.uint8))
            A = m.alloc_window(64)
            S = m.signal_window(1)
            for w in (U, A, S):
                assert w.mode == "tcp" and [p for p, _ in w.paths] == ["tcp", "tcp"], w.describe()
                assert all("FLAGCX_MESH_TRANSPORT=tcp" in why for _, why in w.paths), w.paths
            m.barrier(timeout=10)  # see test_threads_op_right_after_registration_lands
            m.put_signal(1 - r, A, 0, U, 0, 64, 0)
            m.wait_signal(0, 1, timeout=10)
            m.barrier(timeout=10)
            return True

        assert run_threads(2, body, timeout=60) == [True, True]
    finally:
        close_all(meshes)


def test_threads_closed_mesh_refuses_everything():
    meshes = thread_meshes(2)
    wins = run_threads(2, lambda r: (meshes[r].alloc_window(16), meshes[r].signal_window(1)), timeout=30)
    close_all(meshes)
    A, S = wins[0]
    m = meshes[0]
    for call in (lambda: m.put(1, A, 0, A, 0, 1), lambda: m.signal(1, 0), lambda: m.get(1, A, 0, A, 0, 1),
                 lambda: m.flush(), lambda: m.read_signal(0), lambda: m.wait_signal(0, 1, timeout=1),
                 lambda: m.alloc_window(8), lambda: A.close()):
        with pytest.raises(MeshClosed, match="closed"):
            call()


def test_threads_op_right_after_registration_lands(monkeypatch):
    """Registration is collective: once it returns on any rank, every rank must accept ops on
    the new window. Over tcp, signal right after each of 40 registrations; none may be lost.

    Regression test, bug found while writing these tests: a rank adds a new window to its table only
    after the last registration allgather, so a tcp put/signal a faster peer issues right after
    registering is dropped ('not a signal slot here')."""
    meshes = thread_meshes(2)
    try:
        monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")

        def body(r):
            m, lost = meshes[r], []
            for i in range(40):
                S = m.signal_window(1)
                m.signal(1 - r, 0, 1, signal_window=S)
                try:
                    m.wait_signal(0, 1, timeout=0.5, window=S)
                except MeshTimeout:
                    lost.append(S.index)
                if b"lost" in m.allgather(b"lost" if lost else b"ok", timeout=10):
                    break  # one is enough
            return lost

        lost = run_threads(2, body, timeout=120)
        assert lost == [[], []], f"signals lost right after registering windows {lost} (per rank)"
    finally:
        close_all(meshes)


def cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def test_threads_ops_to_a_closed_peer_fail_without_spinning(monkeypatch):
    """Regression test, bug found while writing these tests: ops to a peer that closed its mesh
    (said goodbye) stay queued; the progress thread spins on the dead socket at 100% CPU and close()
    waits its full second."""
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    meshes = thread_meshes(2)
    try:
        wins = run_threads(2, lambda r: meshes[r].alloc_window(1 << 20), timeout=30)
        meshes[1].close()
        time.sleep(0.2)  # its goodbye arrives
        m, A = meshes[0], wins[0]
        with pytest.raises(PeerLost, match="peer 1 closed its mesh"):  # from a put, or from flush
            for _ in range(8):
                m.put(1, A, 0, A, 0, 1 << 20)
            m.flush(1, timeout=10)
        c0 = cpu_seconds()
        time.sleep(0.5)
        busy = (cpu_seconds() - c0) / 0.5
        t0 = time.monotonic()
        m.close()
        took = time.monotonic() - t0
        assert busy < 0.3 and took < 0.5, f"{busy:.2f} CPU s/s while idle; close() took {took:.2f} s"
    finally:
        close_all(meshes)


def test_threads_signal_over_tcp_after_deregistering_window_0_is_silent(monkeypatch, capfd):
    """Regression test, bug found while writing these tests: signal-only ops over tcp are sent as a
    put to window #0; when #0 was deregistered the target logs a spurious 'dropped a put'."""
    meshes = thread_meshes(2)
    try:
        monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")

        def body(r):
            m = meshes[r]
            first = m.register_window(np.zeros(64, np.uint8))  # window #0
            S = m.signal_window(2)
            first.close()
            m.signal(1 - r, 1, 3)
            m.flush(timeout=10)
            m.wait_signal(1, 3, timeout=10)
            m.barrier(timeout=10)
            S.close()
            return True

        assert run_threads(2, body, timeout=60) == [True, True]
    finally:
        close_all(meshes)
    err = capfd.readouterr().err
    assert "dropped" not in err, err


def test_threads_negative_and_huge_integers_raise_invalid_argument():
    """Regression test, bug found while writing these tests: negative or > 64-bit
    offsets/sizes/peers/slots reach pybind11 and raise a TypeError ('incompatible function
    arguments') instead of InvalidArgument naming the argument."""
    meshes = thread_meshes(2)
    try:
        def body(r):
            m = meshes[r]
            U = m.register_window(np.zeros(64, np.uint8))
            m.signal_window(1)
            bad = [("src_off", lambda: m.put(1 - r, U, -1, U, 0, 1)),
                   ("size", lambda: m.put(1 - r, U, 0, U, 0, -1)),
                   ("dst_off", lambda: m.get(1 - r, U, 0, U, 2 ** 64, 1)),
                   ("peer", lambda: m.put(2 ** 40, U, 0, U, 0, 1)),
                   ("slot", lambda: m.signal(1 - r, -1)),
                   ("value", lambda: m.signal(1 - r, 0, value=-1)),
                   ("nbytes", lambda: m.alloc_window(-1))]
            for name, call in bad:
                with pytest.raises(InvalidArgument, match=name):
                    call()
            m.barrier(timeout=10)
            return True

        assert run_threads(2, body, timeout=60) == [True, True]
    finally:
        close_all(meshes)


def test_threads_bad_count_on_one_rank_fails_every_rank_at_once():
    """Regression test: alloc_window / signal_window refused a bad count before joining the
    registration collective, so the other ranks waited for the timeout. numpy integer
    scalars are counts too."""
    meshes = thread_meshes(2)
    try:
        def body(r):
            m = meshes[r]
            assert m.alloc_window(np.int64(64)).index == 0
            t0 = time.monotonic()
            for call in (lambda: m.alloc_window("64" if r == 1 else 64),
                         lambda: m.signal_window(-1 if r == 0 else 4)):
                with pytest.raises(InvalidArgument, match="rank 1: alloc_window|rank 0: signal_window"):
                    call()
            return time.monotonic() - t0

        took = run_threads(2, body, timeout=50)
        assert max(took) < 20, took
    finally:
        close_all(meshes)


def test_alloc_window_buffer_after_close_does_not_crash():
    """Either close() refuses while views are exported (BufferError / InvalidArgument), or the
    views stay readable; the process must not die.

    Regression test, bug found while writing these tests: Window.close() unmaps an alloc window
    while memoryviews from Window.buffer still point at it: touching one segfaults."""
    code = textwrap.dedent("""
        import numpy as np, flagcx_mesh
        from flagcx_mesh import Mesh, InvalidArgument
        m = Mesh(1, flagcx_mesh.get_unique_id(), 0, timeout=20)
        w = m.alloc_window(1 << 20)
        a = np.frombuffer(w.buffer, np.uint8)
        a[:] = 7
        try:
            w.close()
        except (BufferError, InvalidArgument) as e:
            print("refused:", e)
        print("value", int(a[12345]), flush=True)
        m.close()
    """)
    p = subprocess.run([PY, "-c", code], env=subprocess_env(), cwd=HERE, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "value 7" in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])


def test_threads_register_torch_cpu_tensor():
    """Regression test, bug found while writing these tests: register_window() only takes the buffer
    protocol; torch CPU tensors (issue item 1) have none and are refused."""
    torch = pytest.importorskip("torch")
    meshes = thread_meshes(2)
    try:
        def body(r):
            m = meshes[r]
            t = torch.full((256,), r + 1, dtype=torch.uint8)
            W = m.register_window(t)
            m.signal_window(1)
            m.put_signal(1 - r, W, 0, W, 128, 128, 0)
            m.wait_signal(0, 1, timeout=10)
            assert t[128:].tolist() == [2 - r] * 128
            m.barrier(timeout=10)
            return True

        assert run_threads(2, body, timeout=60) == [True, True]
    finally:
        close_all(meshes)


def test_threads_batch_put_array_and_entry_errors():
    """batch_put takes an (n, 3) uint64 array in place; a bad entry (list or array) is refused by
    the core naming the entry, and nothing of the batch is issued; peer sizes come from the core."""
    meshes = thread_meshes(2)

    def body(r):
        m, peer = meshes[r], 1 - r
        src = np.full(4096, 10 + r, np.uint8)
        dst = np.zeros(4096 + 8 * r, np.uint8)
        S, D = m.register_window(src), m.register_window(dst)
        assert D.peer_sizes == (4096, 4104) and S.peer_sizes == (4096, 4096)
        m.barrier(timeout=10)
        c0 = m.read_counter()
        m.batch_put(peer, S, D, np.array([[0, 0, 16], [100, 2000, 50]], dtype=np.uint64))
        with pytest.raises(InvalidArgument, match=r"batch_put entry 1: .*remote range"):
            m.batch_put(peer, S, D, [(0, 3000, 1), (0, 4100 + 8 * peer, 16)])
        with pytest.raises(InvalidArgument, match=r"batch_put entry 2: .*local range"):
            m.batch_put(peer, S, D, np.array([[0, 3000, 1], [0, 3001, 1], [4095, 0, 2]], dtype=np.uint64))
        with pytest.raises(InvalidArgument, match="uint64"):
            m.batch_put(peer, S, D, np.array([[0, 3000, 1]], dtype=np.int32))
        with pytest.raises(InvalidArgument, match="batch_put entry 0: size -1"):
            m.batch_put(peer, S, D, [(0, 3000, -1)])
        m.flush(peer, timeout=10)
        assert m.read_counter() - c0 == 2
        m.barrier(timeout=10)
        assert (dst[0:16] == 10 + peer).all() and (dst[2000:2050] == 10 + peer).all()
        assert dst[3000:3002].tolist() == [0, 0]  # refused batches issued nothing
        m.barrier(timeout=10)
        return True

    try:
        assert run_threads(2, body, timeout=60) == [True, True]
    finally:
        close_all(meshes)
