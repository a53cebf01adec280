"""flagcx_mesh.compat: the FlagCX-shaped API, ranks as threads and as processes.

Threads: every call, ADD semantics, size 0 / sig_val 0, bad input refused with
InvalidArgument naming it and nothing written, registration order, several communicators
at once, result codes and their strings, timeouts. Processes: tests/compat_prog.py and
examples/pd_kv_transfer.py under the embedded launcher.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import time
from types import SimpleNamespace

import numpy as np
import pytest

from flagcx_mesh import compat as fc
from flagcx_mesh import errors
from meshutil import PY, REPO_ROOT, run_threads, subprocess_env

pytestmark = pytest.mark.timeout(150)

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(REPO_ROOT, "examples", "pd_kv_transfer.py")
R = fc.Result


def comms(n=2, timeout=30):
    uid = fc.get_unique_id()
    return run_threads(n, lambda r: fc.comm_init_rank(n, uid, r, timeout=timeout), timeout=timeout + 15)


def each(cs, body, timeout=60):
    """body(comm) on every rank's thread; destroys the comms afterwards."""
    try:
        return run_threads(len(cs), lambda r: body(cs[r]), timeout=timeout)
    finally:
        for c in cs:
            c.destroy()


def refused(code, *fragments):
    """A context manager: the block raises FlagcxError with `code` and every fragment in its text."""
    class Check:
        def __enter__(self):
            return self

        def __exit__(self, kind, e, tb):
            assert kind is fc.FlagcxError, f"expected FlagcxError({code.name}), got {kind}: {e}"
            assert e.code == code, f"{e!r}: code {e.code!r}, expected {code!r}"
            for f in fragments:
                assert f in str(e), f"{f!r} not in {str(e)!r}"
            self.error = e
            return True
    return Check()


# ----------------------------------------------------------------------------- codes and strings

def test_result_codes_have_flagcx_values():
    assert [(r.name, int(r)) for r in R] == [
        ("Success", 0), ("UnhandledDeviceError", 1), ("SystemError", 2), ("InternalError", 3),
        ("InvalidArgument", 4), ("InvalidUsage", 5), ("RemoteError", 6), ("InProgress", 7),
        ("UnhandledCCLError", 8), ("NotSupported", 9)]
    assert fc.flagcxInvalidArgument == 4 and fc.flagcxRemoteError is R.RemoteError


@pytest.mark.parametrize("code", list(R) + [10, -1, 1000, "x"])
def test_get_error_string_describes_every_code(code):
    text = fc.get_error_string(code)
    assert text and "not implemented" not in text.lower()
    if code in list(R):
        assert text.split(":")[0].replace(" ", "").lower() in R(code).name.lower() or code == R.Success
    else:
        assert "unknown result code" in text


@pytest.mark.parametrize("exc, code", [
    (errors.InvalidArgument("x"), R.InvalidArgument),
    (errors.MeshClosed("x"), R.InvalidUsage),
    (errors.PeerLost("x", peer=3), R.RemoteError),
    (errors.ProtocolError("x"), R.RemoteError),
    (errors.SystemCallError("x", errno=12), R.SystemError),
    (errors.MeshTimeout("x"), R.InProgress),
    (errors.MeshError("x"), R.InternalError),
    (MemoryError(), R.SystemError),
])
def test_mesh_errors_map_to_flagcx_codes(exc, code):
    with refused(code, "op: ") as c:
        fc._translate(None, exc, "op")
    assert c.error.peer == getattr(exc, "peer", -1) and c.error.errno == (getattr(exc, "errno", 0) or 0)
    assert c.error.__cause__ is exc and fc.get_last_error() == str(c.error)


def test_flagcx_error_pickles():
    e = fc.FlagcxError(R.RemoteError, "rank 1: flush: peer 0 lost", peer=0, errno=104, rank=1)
    back = pickle.loads(pickle.dumps(e))
    assert (back.code, back.peer, back.errno, back.rank, str(back)) == (e.code, 0, 104, 1, str(e))
    assert str(e).endswith("[flagcxRemoteError (6)]")


# ----------------------------------------------------------------------------- creation

def test_comm_init_rank_refuses_a_malformed_unique_id():
    with refused(R.InvalidArgument, "unique_id has 10 bytes, expected 256"):
        fc.comm_init_rank(2, b"0123456789", 0)
    with refused(R.InvalidArgument, "unique_id must be bytes"):
        fc.comm_init_rank(2, 12, 0)


def test_comm_init_rank_times_out_as_remote_error_naming_the_missing_rank():
    t0 = time.monotonic()
    with refused(R.RemoteError, "rank 0: comm_init_rank(nranks=2)", "1") as c:
        fc.comm_init_rank(2, fc.get_unique_id(), 0, timeout=1.0)
    assert time.monotonic() - t0 < 10, "the build did not honour its timeout"
    assert fc.get_last_error() == str(c.error)


def test_several_communicators_at_once_from_threads_are_isolated():
    """3 communicators x 2 ranks built concurrently (6 threads); each moves its own pattern
    on the same window index and slot; nothing crosses between them."""
    uids = [fc.get_unique_id() for _ in range(3)]

    def body(t):
        k, r = divmod(t, 2)
        with fc.comm_init_rank(2, uids[k], r, timeout=30) as c:
            buf = np.full(256, 10 * k + r, np.uint8)
            idx = c.one_side_register(buf)
            c.signal_register(8)
            c.put_signal(1 - r, 0, 128, 128, 0, idx, idx, k + 1)
            c.wait_signal(1 - r, 0, k + 1, timeout=10)
            assert c.read_signal(0) == k + 1
            assert (buf[128:] == 10 * k + 1 - r).all() and (buf[:128] == 10 * k + r).all()
            c.mesh.barrier(timeout=10)
            return c.mesh.mesh_id

    ids = run_threads(6, body, timeout=90)
    assert len(set(ids)) == 3 and ids[0] == ids[1]


# ----------------------------------------------------------------------------- every call

def test_every_call_ranks_as_threads():
    """Registration indices, put, put_signal, signal, wait_signal, read_signal, batch_put over
    two windows, flush, read_counter, wait_counter, window_buffer / describe, destroy."""
    cs = comms(2)

    def body(c):
        r, peer = c.rank, 1 - c.rank
        user = np.zeros(4096, np.uint8)
        user[:1024] = r + 1
        assert c.one_side_register(user) == 0 and c.one_side_register(2048) == 1
        slots = c.signal_register(np.zeros(4, np.uint64))
        assert slots.format == "Q" and len(slots) == 4 and slots.readonly
        lib = c.window_buffer(1)
        assert len(lib) == 2048 and "peer" in c.window_describe(0)
        c0 = c.read_counter()
        c.mesh.barrier(timeout=10)
        c.put(peer, 0, 1024, 100, 0, 0)
        c.put_signal(peer, 0, 0, 1024, 8, 0, 1, 1)
        c.signal(peer, 16, 5)
        c.batch_put(peer, [(0, 2048, 10), (0, 1024, 20, 0, 1), (50, 3000, 5)])
        c.put_signal(peer, 0, 0, 0, 24, 0, 0, 1)
        c.flush(peer, timeout=10)
        c.wait_counter(c0 + 7, timeout=10)
        assert c.read_counter() - c0 == 7
        c.wait_signal(peer, 24, 1, timeout=10)
        assert [c.read_signal(8 * i) for i in range(4)] == [0, 1, 5, 1] == list(slots)
        want = peer + 1
        assert (user[1024:1124] == want).all() and (user[2048:2058] == want).all()
        assert (user[3000:3005] == want).all() and user[1124] == 0 and user[2058] == 0
        assert bytes(lib[:1024]) == bytes([want]) * 1024 and bytes(lib[1024:1044]) == bytes([want]) * 20
        c.mesh.barrier(timeout=10)
        return True

    assert each(cs, body) == [True, True]
    with refused(R.InvalidUsage, "destroyed"):
        cs[0].put(1, 0, 0, 1, 0, 0)
    cs[0].destroy()  # idempotent


def test_put_signal_adds_and_size_0_and_sig_val_0():
    """Several put_signals ADD up; size 0 changes only the slot; sig_val 0 changes only data."""
    cs = comms(2)

    def body(c):
        r, peer = c.rank, 1 - c.rank
        buf = np.full(1024, 100 + r, np.uint8)
        idx = c.one_side_register(buf)
        c.signal_register(16)
        c.mesh.barrier(timeout=10)
        for v in (1, 2, 3, 4):  # sources at 512.. are never written by the peer
            c.put_signal(peer, 512, 0, 64, 0, idx, idx, v)
        c.wait_signal(peer, 0, 10, timeout=10)
        c.put_signal(peer, 512, 512, 0, 8, idx, idx, 7)     # signal only
        c.put_signal(peer, 512, 256, 128, 0, idx, idx, 0)   # data only
        c.signal(peer, 8, 0)                                # adds nothing
        c.flush(timeout=10)
        c.mesh.barrier(timeout=10)
        assert c.read_signal(0) == 10 and c.read_signal(8) == 7
        assert (buf[:64] == 100 + peer).all() and (buf[256:384] == 100 + peer).all()
        assert (buf[64:256] == 100 + r).all() and (buf[384:] == 100 + r).all()
        c.mesh.barrier(timeout=10)
        return True

    assert each(cs, body) == [True, True]


def test_numpy_and_torch_integer_scalars_are_integers():
    """Offsets computed with numpy (or torch) work like ints; arrays, floats and bools do not."""
    with fc.comm_init_rank(1, fc.get_unique_id(), 0, timeout=30) as c:
        buf = np.zeros(64, np.uint8)
        buf[:8] = 9
        idx = c.one_side_register(buf)
        c.signal_register(np.int64(16))
        c.put_signal(np.int32(0), np.uint64(0), np.int64(16), np.int16(8), np.int64(8), idx, np.int8(0),
                     np.uint64(2))
        c.batch_put(0, [(np.int64(0), np.int64(32), np.int64(4))])
        c.wait_counter(np.int64(2), timeout=10)
        c.wait_signal(np.int64(0), np.uint32(8), np.int64(2), timeout=10)
        assert (buf[16:24] == 9).all() and (buf[32:36] == 9).all() and c.read_signal(np.int64(8)) == 2
        for bad, name in ((np.array([1, 2]), "size array"), (True, "size True"), (0.5, "size 0.5")):
            with refused(R.InvalidArgument, name):
                c.put(0, 0, 0, bad, idx, idx)


def bad_calls(c, idx, peer, n):
    """(code, fragments, call) triples: every one must be refused before anything is issued."""
    A = R.InvalidArgument
    return [
        (A, ["sig_off 4", "multiple of 8"], lambda: c.put_signal(peer, 0, 0, 8, 4, idx, idx, 1)),
        (A, ["sig_off 12"], lambda: c.signal(peer, 12, 1)),
        (A, ["sig_off 32 (slot 4)", "beyond the signal buffer of peer"], lambda: c.signal(peer, 32, 1)),
        (A, ["sig_off 32 (slot 4)", "this rank"], lambda: c.wait_signal(peer, 32, 1, timeout=1)),
        (A, ["sig_off -8"], lambda: c.read_signal(-8)),
        (A, [f"peer {n} out of range [0, {n})"], lambda: c.put(n, 0, 0, 1, idx, idx)),
        (A, ["peer -1 out of range"], lambda: c.signal(-1, 0, 1)),
        (A, ["peer 7 out of range"], lambda: c.wait_signal(7, 0, 1, timeout=1)),
        (A, ["dst_idx 5 is not registered"], lambda: c.put(peer, 0, 0, 1, idx, 5)),
        (A, ["src_idx -1 is not registered"], lambda: c.put(peer, 0, 0, 1, -1, idx)),
        (A, ["src_off 1000 + size 100 exceeds window 0 of rank"], lambda: c.put(peer, 1000, 0, 100, idx, idx)),
        (A, ["dst_off 1020 + size 8 exceeds window 0 of peer"],
         lambda: c.put_signal(peer, 0, 1020, 8, 0, idx, idx, 1)),
        (A, ["size -1"], lambda: c.put(peer, 0, 0, -1, idx, idx)),
        (A, ["sig_val -1"], lambda: c.signal(peer, 0, -1)),
        (A, ["batch_put(peer", "op 1: dst_off 1024 + size 1"],
         lambda: c.batch_put(peer, [(0, 0, 8), (0, 1024, 1)], idx, idx)),
        (A, ["op 0: (0, 0) is not (src_off"], lambda: c.batch_put(peer, [(0, 0)])),
        (A, ["expected -2"], lambda: c.wait_signal(peer, 0, -2, timeout=1)),
        (A, ["index 9 is not registered"], lambda: c.window_buffer(9)),
    ]


def test_bad_input_is_refused_naming_it_and_nothing_is_written():
    cs = comms(2)

    def body(c):
        r, peer = c.rank, 1 - c.rank
        buf = np.full(1024, 50 + r, np.uint8)
        idx = c.one_side_register(buf)
        c.signal_register(32)
        c.mesh.barrier(timeout=10)
        counter = c.read_counter()
        for code, fragments, call in bad_calls(c, idx, peer, 2):
            with refused(code, f"rank {r}", *fragments) as check:
                call()
            assert c.get_last_error() == str(check.error)
        c.mesh.barrier(timeout=10)
        assert (buf == 50 + r).all() and c.read_counter() == counter
        assert [c.read_signal(8 * i) for i in range(4)] == [0, 0, 0, 0]
        c.mesh.barrier(timeout=10)
        return True

    assert each(cs, body) == [True, True]


def test_usage_errors_before_signal_register_and_after_deregister():
    """Indices follow registration order (signal buffers do not take one); a deregistered index
    is not reused and names itself; a second signal buffer and ops without one are InvalidUsage."""
    cs = comms(2)

    def body(c):
        peer = 1 - c.rank
        with refused(R.InvalidUsage, "no signal buffer: call signal_register() first"):
            c.signal(peer, 0, 1)
        assert c.one_side_register(64) == 0
        c.signal_register(8)
        assert c.one_side_register(bytearray(64)) == 1
        c.one_side_deregister(0)
        assert c.one_side_register(np.zeros(8, np.uint8)) == 2
        with refused(R.InvalidUsage, "src_idx 0 was deregistered"):
            c.put(peer, 0, 0, 1, 0, 1)
        with refused(R.InvalidUsage, "already registered"):
            c.signal_register(8)
        c.put_signal(peer, 0, 0, 8, 0, 1, 2, 1)
        c.wait_signal(peer, 0, 1, timeout=10)
        c.mesh.barrier(timeout=10)
        return True

    assert each(cs, body) == [True, True]


def _cuda_driver_loads() -> bool:
    import ctypes
    try:
        ctypes.CDLL(os.environ.get("FLAGCX_MESH_CUDA_DRIVER") or "libcuda.so.1")
        return True
    except OSError:
        return False


# On a GPU host the fake device pointer below reaches a real driver, which refuses it otherwise
# than "no CUDA driver" (the device tests cover that host: tests/test_gpu.py).
@pytest.mark.skipif(_cuda_driver_loads(), reason="a CUDA driver loads here: this case needs a host without one")
def test_registration_refused_on_one_rank_fails_every_rank_at_once():
    """A misaligned signal size, or device memory (NotSupported), on one rank: every rank's
    registration fails at once instead of waiting for the others until a timeout."""
    cs = comms(2)
    # CUDA memory as a CUDA array (never dereferenced): without a CUDA driver it is NotSupported.
    gpu = SimpleNamespace(__cuda_array_interface__={"shape": (64,), "typestr": "|u1", "data": (4096, False),
                                                    "version": 3})

    def body(c):
        t0 = time.monotonic()
        if c.rank == 0:
            with refused(R.InvalidArgument, "size 12 is not a positive multiple of 8"):
                c.signal_register(12)
            with refused(R.NotSupported, "device memory cannot be registered: no CUDA driver"):
                c.one_side_register(gpu)
        else:
            with refused(R.RemoteError, "rank 0"):
                c.signal_register(16)
            with refused(R.RemoteError, "rank 0"):
                c.one_side_register(64)
        assert time.monotonic() - t0 < 10
        c.signal_register(16)  # the failed ones took no slot
        assert c.one_side_register(64) == 0
        return True

    assert each(cs, body) == [True, True]


def test_wait_signal_timeout_is_in_progress_with_a_clear_message():
    cs = comms(2)

    def body(c):
        peer = 1 - c.rank
        c.signal_register(32)
        c.mesh.barrier(timeout=10)
        c.signal(peer, 16, 2)
        c.flush(timeout=10)
        c.mesh.barrier(timeout=10)
        t0 = time.monotonic()
        with refused(R.InProgress, f"rank {c.rank}", f"wait_signal(peer {peer}, sig_off 16, expected 3)",
                     "slot 2", "current 2", f"last signalled by rank {peer}", "timed out") as check:
            c.wait_signal(peer, 16, 3, timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 5
        assert check.error.peer == peer and c.get_last_error() == str(check.error)
        with refused(R.InProgress, "wait_counter", "timed out"):
            c.wait_counter(c.read_counter() + 1000, timeout=0.2)
        c.mesh.barrier(timeout=10)
        return True

    assert each(cs, body) == [True, True]


def test_ops_to_a_destroyed_peer_fail_as_remote_error(monkeypatch):
    """After the peer destroys its comm, puts + flush to it raise RemoteError naming it (over
    tcp, where the peer's side is needed); the destroyed comm itself says InvalidUsage."""
    monkeypatch.setenv("FLAGCX_MESH_TRANSPORT", "tcp")
    cs = comms(2)
    c0, c1 = cs
    run_threads(2, lambda r: (cs[r].one_side_register(1 << 20), cs[r].signal_register(8)), timeout=30)
    c1.destroy()
    time.sleep(0.2)  # its goodbye arrives
    try:
        with refused(R.RemoteError, "rank 0: ", "peer 1") as check:
            for _ in range(8):
                c0.put(1, 0, 0, 1 << 20, 0, 0)
            c0.flush(1, timeout=10)
        assert check.error.peer == 1
        with refused(R.InvalidUsage, "destroyed"):
            c1.wait_signal(0, 0, 1, timeout=1)
    finally:
        c0.destroy()


# ----------------------------------------------------------------------------- processes

def launch(argv, n, timeout=90):
    cmd = [PY, "-m", "flagcx_mesh.launch", "-n", str(n), "--timeout", str(timeout), "--grace", "1", *argv]
    try:
        return subprocess.run(cmd, env=subprocess_env(), cwd=HERE, capture_output=True, text=True,
                              timeout=timeout + 30)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{argv}: the launcher hung past {timeout + 30} s\n{e.stdout}\n{e.stderr}")


@pytest.mark.parametrize("n", [2, 4])
def test_processes_under_the_launcher(n):
    p = launch([os.path.join(HERE, "compat_prog.py"), "--timeout", "30"], n)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    for r in range(n):
        assert f"OK rank {r} compat: {n} peers, 5 bad calls refused" in p.stdout, p.stdout[-3000:]


def test_example_under_the_launcher():
    p = launch([EXAMPLE, "--layers", "6", "--chunks", "8", "--chunk-bytes", "65536", "--rounds", "2",
                "--timeout", "30"], 2)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    assert "[rank 1] decode: all 2 round(s) passed: checksums match" in p.stdout, p.stdout[-3000:]
    assert p.stdout.count("checksums match prefill's for all 6 layers") == 4, p.stdout[-3000:]
    assert p.stdout.count("checksum ok") == 6 and "GB/s" in p.stdout


def test_example_fails_on_corrupted_data():
    """--corrupt-layer: prefill damages one byte of a layer after checksumming it; both ranks
    exit non-zero and decode names the layer."""
    p = launch([EXAMPLE, "--layers", "3", "--chunks", "2", "--chunk-bytes", "4096", "--rounds", "1",
                "--timeout", "30", "--corrupt-layer", "1"], 2)
    assert p.returncode == 1, f"exit {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    assert "FAIL: layer 1: checksum" in p.stdout and "checksum MISMATCH" in p.stdout, p.stdout[-3000:]


def test_example_under_torchrun():
    """`torchrun --standalone --nproc_per_node=2 examples/pd_kv_transfer.py` (skipped without
    torch unless FXM_REQUIRE_TORCH=1)."""
    if os.environ.get("FXM_REQUIRE_TORCH") != "1":
        pytest.importorskip("torch.distributed", reason="torch is not installed (pip install torch==2.13.0)")
    from bootstrap_helpers import run

    res = run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", EXAMPLE,
               "--layers", "4", "--chunks", "4", "--chunk-bytes", "65536", "--rounds", "2", "--timeout", "30"],
              180)
    assert res.rc == 0 and not res.timed_out, res
    assert "launcher torchrun" in res.out and "decode: all 2 round(s) passed: checksums match" in res.out, res
