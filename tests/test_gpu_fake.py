"""Device windows on the fake CUDA driver (no GPU needed): path choice and fallbacks, data
integrity over every path, stream ordering, bad input, a killed peer, the C ABI and compat.

Every job loads the fake driver through FLAGCX_MESH_CUDA_DRIVER (tests/fakecuda.py) in its own
processes: a process that ever loaded no driver keeps that answer, so nothing here loads the
fake into the pytest process. The same scenarios run on a real GPU with scripts/test-gpu.sh.
"""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

import fakecuda
import gpujobs
from meshutil import PY

pytestmark = pytest.mark.timeout(180)

HERE = os.path.dirname(os.path.abspath(__file__))
JOB_TIMEOUT = 90


def fake_env(**extra):
    return gpujobs.job_env(fakecuda.env(granularity=64 << 10),
                           ("FLAGCX_MESH_CUDA_PATH", "FLAGCX_MESH_TRANSPORT", "FXM_FAKECUDA_FAIL",
                            "FXM_FAKECUDA_NO_STREAM_MEMOPS"), **extra)


def run_job(n, scenario, *args, env=None, silent=()):
    return gpujobs.run_job(n, scenario, *args, env=env or fake_env(), device="fake",
                           timeout=JOB_TIMEOUT, silent=silent)


def run_python(code, env, timeout=60):
    p = subprocess.run([PY, "-c", textwrap.dedent(code)], env=env, cwd=HERE, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


# ---------------------------------------------------------------- paths and integrity

@pytest.mark.parametrize("forced, alloc, user", [
    ("auto", "cuda-vmm", "cuda-ipc"),
    ("cuda-vmm", "cuda-vmm", "staged"),  # a cudaMalloc buffer has no cuMem fd: staged, saying why
    ("cuda-ipc", "staged", "cuda-ipc"),  # cuMem memory has no legacy IPC handle
    ("staged", "staged", "staged"),
])
def test_every_path_forced_and_automatic_moves_the_right_bytes(forced, alloc, user):
    env = fake_env() if forced == "auto" else fake_env(FLAGCX_MESH_CUDA_PATH=forced)
    p = run_job(3, "integrity", "--expect-alloc", alloc, "--expect-user", user, env=env)
    assert f"modes alloc={alloc} user={user}" in p.stdout


def test_a_tensor_of_several_cuMem_mappings_is_exported_mapping_by_mapping():
    p = run_job(2, "integrity", "--user", "multimap", "--expect-alloc", "cuda-vmm", "--expect-user", "cuda-vmm")
    assert "modes alloc=cuda-vmm user=cuda-vmm" in p.stdout


def test_a_signal_on_a_stream_never_passes_the_waiting_stream_before_its_data():
    run_job(2, "stream", "--rounds", "100")


def test_without_stream_memory_operations_the_wait_falls_back_to_the_host_and_says_so():
    p = run_job(2, "stream", "--rounds", "30", env=fake_env(FXM_FAKECUDA_NO_STREAM_MEMOPS=1))
    assert "waits on the host: the driver has no stream memory operations" in p.stdout + p.stderr


def test_the_legacy_default_stream_works_for_stream_waits_and_puts():
    run_job(2, "stream", "--rounds", "30", "--legacy-stream")


def test_compat_across_processes_registers_device_buffers_and_orders_on_streams():
    run_job(3, "compat")


def test_selftest_checks_device_windows():
    p = subprocess.run([PY, "-m", "flagcx_mesh.selftest", "-n", "3", "--iterations", "2", "--device", "cuda:0"],
                       env=fake_env(), cwd=HERE, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "device windows on cuda:0: every byte checked" in p.stdout
    assert "peer 1 cuda-vmm, peer 2 cuda-vmm" in p.stdout, p.stdout


def test_the_stream_wait_benchmark_builds_and_runs():
    """The C stream-wait benchmark compiles against the installed library and runs (on the fake
    driver its figures mean nothing: the fake polls every ~20 us)."""
    p = subprocess.run([PY, "-m", "flagcx_mesh.bench", "stream-wait", "--iters", "20"], env=fake_env(), cwd=HERE,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "stream wait from C: a waiting stream passes" in p.stdout, p.stdout


def test_bad_input_on_device_windows_is_refused_and_writes_nothing():
    run_job(2, "bad_input")


def test_a_peer_killed_during_device_puts_fails_flush_naming_it():
    p = run_job(2, "peer_death", silent=(1,))
    assert "peer loss seen after" in p.stdout


# ---------------------------------------------------------------- one process

def test_without_a_driver_device_memory_is_refused_naming_the_missing_driver():
    env = fake_env(FLAGCX_MESH_CUDA_DRIVER="/nonexistent/libcuda.so.1")
    p = run_python("""
        import flagcx_mesh as fm
        from types import SimpleNamespace
        gpu = SimpleNamespace(__cuda_array_interface__={"shape": (64,), "typestr": "|u1",
                                                       "data": (4096, False), "version": 3})
        m = fm.Mesh(1, fm.get_unique_id(), 0)
        for call in (lambda: m.register_window(gpu), lambda: m.alloc_window(64, device=0)):
            try:
                call()
            except fm.InvalidArgument as e:
                print("REFUSED", e)
        w = m.alloc_window(64)  # host windows still work
        print("HOST", w.mode)
    """, env)
    lines = [l for l in p.stdout.splitlines() if l.startswith("REFUSED")]
    assert len(lines) == 2, p.stdout
    for line in lines:
        assert "no CUDA driver" in line and "/nonexistent/libcuda.so.1" in line, line
    assert "HOST self" in p.stdout


def test_fabric_refused_is_a_quiet_logged_fallback_to_a_posix_fd_handle():
    p = run_python("""
        import flagcx_mesh as fm
        m = fm.Mesh(1, fm.get_unique_id(), 0)
        w = m.alloc_window(1 << 16, device=0)
        print("DEVICE", w.device, w.kind, w.mode)
    """, fake_env(FLAGCX_MESH_LOG="info"))
    assert "DEVICE 0 device cuda-self" in p.stdout
    assert "FABRIC handle refused (CUDA_ERROR_NOT_PERMITTED" in p.stderr
    assert "flagcx_mesh WARN" not in p.stderr and "flagcx_mesh ERROR" not in p.stderr, p.stderr


def test_ranks_as_threads_copy_directly_and_a_driver_refusal_is_named_in_describe():
    """Two thread ranks in one process take cuda-self; with cuIpcGetMemHandle failing, another
    process's view says why cuda-ipc was refused (checked through describe() of a 2-rank job)."""
    p = run_python("""
        import flagcx_mesh as fm, fakecuda
        from meshutil import run_threads
        cu = fakecuda.FakeCuda.get()
        uid = fm.get_unique_id()
        def rank(r):
            with fm.Mesh(2, uid, r, timeout=30) as m:
                buf = fakecuda.DeviceBuffer(4096, cu)
                w = m.register_window(buf)
                a = m.alloc_window(4096, device=0)
                buf.write(bytes([r + 1]) * 4096)
                m.barrier(timeout=30)
                m.put(1 - r, w, 0, a, 0, 4096, stream=cu.stream())
                m.flush(timeout=30)
                m.barrier(timeout=30)
                got = cu.read(a._address, 4096)
                assert got == bytes([2 - r]) * 4096, got[:8]
                return w.describe()
        for d in run_threads(2, rank, timeout=60):
            print("DESCRIBE", d)
    """, fake_env())
    assert p.stdout.count("peer 0 cuda-self, peer 1 cuda-self") == 2, p.stdout

    q = run_job(2, "integrity", "--expect-user", "staged",
                env=fake_env(FXM_FAKECUDA_FAIL="cuIpcGetMemHandle=1", FLAGCX_MESH_LOG="info"))
    assert "cuda-ipc refused: cuIpcGetMemHandle: CUDA_ERROR_INVALID_VALUE" in q.stdout + q.stderr


def test_the_c_abi_registers_device_memory_and_orders_ops_on_a_stream():
    p = run_python("""
        import ctypes as C, os, flagcx_mesh as fm, fakecuda
        lib = C.CDLL(os.path.join(os.path.dirname(fm.__file__), "lib", "libflagcx_mesh.so"))
        cu = fakecuda.FakeCuda.get()
        uid = (C.c_char * 256)()
        assert lib.flagcx_mesh_get_unique_id(uid) == 0
        comm = C.c_void_p()
        assert lib.flagcx_mesh_comm_init(C.byref(comm), 1, uid, 0, None) == 0
        idx, sig, base = C.c_uint32(), C.c_uint32(), C.c_void_p()
        assert lib.flagcx_mesh_window_alloc_mem(comm, 8192, 1, 0, C.byref(idx), C.byref(base)) == 0
        assert lib.flagcx_mesh_signal_window(comm, 4, C.byref(sig)) == 0
        user = cu.alloc(8192)
        uidx = C.c_uint32()
        assert lib.flagcx_mesh_window_register_mem(comm, C.c_void_p(user), C.c_uint64(8192), 1, C.byref(uidx)) == 0
        path = C.c_char_p()
        assert lib.flagcx_mesh_window_path(comm, uidx, 0, C.byref(path)) == 0
        print("PATH", path.value.decode())
        cu.write(user, bytes(range(256)) * 32)
        s = cu.stream()
        put = lib.flagcx_mesh_put_signal_on_stream
        put.argtypes = [C.c_void_p, C.c_int, C.c_uint32, C.c_uint64, C.c_uint32, C.c_uint64, C.c_uint64,
                        C.c_uint32, C.c_uint64, C.c_uint64, C.c_void_p]
        assert put(comm, 0, uidx, 0, idx, 0, 8192, sig, 2, 5, C.c_void_p(s)) == 0
        wait = lib.flagcx_mesh_wait_signal_on_stream
        wait.argtypes = [C.c_void_p, C.c_uint32, C.c_uint64, C.c_uint64, C.c_void_p, C.c_double]
        assert wait(comm, sig, 2, 5, C.c_void_p(s), C.c_double(10)) == 0
        cu.synchronize(s)
        assert lib.flagcx_mesh_flush(comm, -1, C.c_double(10)) == 0
        print("SAME", cu.read(base.value, 8192) == bytes(range(256)) * 32)
        bad = lib.flagcx_mesh_window_register_mem(comm, C.c_void_p(user), C.c_uint64(8192), 7, C.byref(uidx))
        lib.flagcx_mesh_last_error.restype = C.c_char_p
        print("BAD", bad, lib.flagcx_mesh_last_error().decode())
        assert lib.flagcx_mesh_comm_destroy(comm) == 0
    """, fake_env())
    assert "PATH cuda-self" in p.stdout and "SAME True" in p.stdout, p.stdout
    assert "mem_type 7 is unknown" in p.stdout, p.stdout


def test_compat_registers_device_tensors_and_waits_on_a_stream():
    p = run_python("""
        import flagcx_mesh.compat as fc, fakecuda
        from meshutil import run_threads
        cu = fakecuda.FakeCuda.get()
        uid = fc.get_unique_id()
        def rank(r):
            c = fc.comm_init_rank(2, uid, r, timeout=30)
            try:
                src, dst = fakecuda.DeviceBuffer(4096, cu), fakecuda.DeviceBuffer(4096, cu)
                s_idx, d_idx = c.one_side_register(src), c.one_side_register(dst)
                c.signal_register(64)
                src.write(bytes([r + 10]) * 4096)
                c.mesh.barrier(timeout=30)
                s = cu.stream()
                c.put_signal(1 - r, 0, 0, 4096, 8, s_idx, d_idx, 1, s)
                c.wait_signal(1 - r, 8, 1, s)
                cu.synchronize(s)
                got = dst.read(4096)  # no flush, no barrier: the stream's wait is the only order
                c.flush(timeout=30)
                c.mesh.barrier(timeout=30)
                return got == bytes([11 - r]) * 4096  # the peer's bytes
            finally:
                c.destroy()
        print("GOT", run_threads(2, rank, timeout=60))
    """, fake_env())
    assert "GOT [True, True]" in p.stdout, p.stdout


# ---------------------------------------------------------------- ordering, errors, bad input

def test_a_signal_on_a_stream_waits_for_an_earlier_staged_put_to_the_pair():
    run_job(2, "staged_stream_signal", "--rounds", "6", env=fake_env(FLAGCX_MESH_CUDA_PATH="staged"))


def test_a_signal_on_a_stream_is_ordered_before_a_later_put_signal_on_another_stream():
    """Rank 0's stream a is held by a stream wait; signal(slot 0) on a, then put_signal(slot 1)
    on stream b: FIFO per pair across streams says slot 0 changes first."""
    p = run_python("""
        import threading, flagcx_mesh as fm, fakecuda
        from meshutil import run_threads
        cu = fakecuda.FakeCuda.get()
        uid = fm.get_unique_id()
        def rank(r):
            with fm.Mesh(2, uid, r, timeout=30) as m:
                sig = m.signal_window(4)
                win = m.alloc_window(4096, device=0)
                m.barrier(timeout=30)
                first = None
                if r == 0:
                    a, b = cu.stream(), cu.stream()
                    m.wait_signal(3, 1, window=sig, stream=a)  # a is held until rank 1 releases it
                    m.signal(1, 0, 1, signal_window=sig, stream=a)
                    m.put_signal(1, win, 0, win, 0, 4096, 1, 1, signal_window=sig, stream=b)
                else:
                    release = threading.Timer(3.0, lambda: m.signal(0, 3, 1, signal_window=sig))
                    release.start()
                    m.wait_signal(1, 1, timeout=30, window=sig)
                    first = m.read_signal(0, window=sig)
                    release.join()
                m.flush(timeout=30)
                m.barrier(timeout=30)
                return first
        print("FIRST", run_threads(2, rank, timeout=60)[1])
    """, fake_env())
    assert "FIRST 1" in p.stdout, p.stdout


def test_an_op_queued_behind_a_blocked_stream_does_not_block_a_host_op_past_the_timeout():
    """A put on a stream held by a stream wait, then a put on a host window to the same pair:
    FIFO keeps the host put behind it, but the call must not block beyond the mesh's timeout
    (it fails with MeshTimeout, or returns with the put queued)."""
    p = run_python("""
        import threading, flagcx_mesh as fm, fakecuda
        from meshutil import run_threads
        cu = fakecuda.FakeCuda.get()
        uid = fm.get_unique_id()
        def rank(r):
            with fm.Mesh(2, uid, r, timeout=3) as m:
                sig = m.signal_window(4)
                dwin = m.alloc_window(4096, device=0)
                hwin = m.alloc_window(4096)
                m.barrier(timeout=30)
                out = None
                if r == 0:
                    a = cu.stream()
                    m.wait_signal(3, 1, window=sig, stream=a)
                    m.put(1, dwin, 0, dwin, 0, 4096, stream=a)
                    try:
                        m.put(1, hwin, 0, hwin, 0, 8)
                        held = m.read_signal(3, window=sig) == 0  # the stream is still held
                        out = "returned while held" if held else "blocked until the stream was released"
                    except fm.MeshError as e:
                        out = type(e).__name__
                else:
                    release = threading.Timer(8.0, lambda: m.signal(0, 3, 1, signal_window=sig))
                    release.start()
                    release.join()
                m.barrier(timeout=30)
                m.flush(timeout=30)
                m.barrier(timeout=30)  # rank 1 closes only once rank 0's ops to it completed
                return out
        print("HOST PUT", run_threads(2, rank, timeout=90)[0])
    """, fake_env(), timeout=120)
    assert "HOST PUT MeshTimeout" in p.stdout or "HOST PUT returned while held" in p.stdout, p.stdout


def test_a_device_copy_that_failed_on_its_stream_fails_flush():
    """cuEventQuery answering an error (a sticky fault of the copy) must not count as done."""
    p = run_python("""
        import flagcx_mesh as fm, fakecuda
        cu = fakecuda.FakeCuda.get()
        with fm.Mesh(1, fm.get_unique_id(), 0, timeout=10) as m:
            w = m.alloc_window(8192, device=0)
            m.put(0, w, 0, w, 4096, 4096, stream=cu.stream())
            try:
                m.flush(timeout=10)
                print("FLUSHED")
            except fm.MeshError as e:
                print("ERROR", e)
    """, fake_env(FXM_FAKECUDA_FAIL="cuEventQuery=700"))
    assert "ERROR" in p.stdout and "CUDA_ERROR_ILLEGAL_ADDRESS" in p.stdout, p.stdout


def test_a_driver_that_fails_cuInit_is_named_with_its_result():
    p = run_python("""
        import flagcx_mesh as fm
        m = fm.Mesh(1, fm.get_unique_id(), 0)
        try:
            m.alloc_window(4096, device=0)
        except fm.InvalidArgument as e:
            print("REFUSED", e)
    """, fake_env(FXM_FAKECUDA_FAIL="cuInit=100"))
    assert "REFUSED" in p.stdout and "CUDA_ERROR_NO_DEVICE" in p.stdout, p.stdout


def test_a_device_range_spanning_two_allocations_is_refused():
    """[p, p + size) must be one allocation: a peer opens only the first one's IPC handle."""
    p = run_python("""
        import flagcx_mesh as fm, fakecuda
        from types import SimpleNamespace
        cu = fakecuda.FakeCuda.get()
        a, b = cu.alloc(1 << 16), cu.alloc(1 << 16)
        lo, hi = min(a, b), max(a, b)
        span = SimpleNamespace(__cuda_array_interface__={"shape": (hi + (1 << 16) - lo,), "typestr": "|u1",
                                                        "data": (lo, False), "version": 3})
        m = fm.Mesh(1, fm.get_unique_id(), 0)
        try:
            w = m.register_window(span)
            print("ACCEPTED", w.size)
        except fm.InvalidArgument as e:
            print("REFUSED", e)
    """, fake_env())
    assert "REFUSED" in p.stdout, p.stdout


def test_a_bad_cuda_path_variable_on_one_rank_fails_the_registration_on_every_rank():
    run_job(2, "bad_cuda_path_env")


def test_a_staged_put_lands_while_the_library_stream_is_ordered_behind_a_held_stream():
    run_job(2, "held_library_stream", env=fake_env(FLAGCX_MESH_CUDA_PATH="cuda-vmm"))


def test_a_put_signal_over_a_device_path_counts_one_op_when_its_signal_goes_over_tcp():
    run_job(2, "counter", env=fake_env(FLAGCX_MESH_TRANSPORT="tcp"))


def test_a_stream_wait_from_a_thread_without_a_current_context_is_queued():
    """The stream was made on another thread; this one never made a CUDA context current (a
    C caller's communication thread): wait_signal(stream=) must still queue the wait."""
    p = run_python("""
        import threading, flagcx_mesh as fm, fakecuda
        cu = fakecuda.FakeCuda.get()
        s = cu.stream()
        with fm.Mesh(1, fm.get_unique_id(), 0, timeout=10) as m:
            sig = m.signal_window(4)
            out = []
            def waiter():
                try:
                    m.wait_signal(0, 1, window=sig, stream=s)
                    out.append("QUEUED")
                except fm.MeshError as e:
                    out.append(f"ERROR {e}")
            t = threading.Thread(target=waiter)
            t.start()
            t.join()
            m.signal(0, 0, 1, signal_window=sig)
            cu.synchronize(s)
            print(out[0])
    """, fake_env())
    assert "QUEUED" in p.stdout, p.stdout


def test_closing_a_mesh_never_frees_a_signal_slot_a_stream_still_waits_on():
    """A stream waits for a signal that never comes (its peer died, say), then the mesh is
    closed: the slot must stay mapped and registered; the stream keeps waiting, it neither
    faults nor runs past the wait."""
    p = run_python("""
        import gc, time, flagcx_mesh as fm, fakecuda
        cu = fakecuda.FakeCuda.get()
        s = cu.stream()
        m = fm.Mesh(1, fm.get_unique_id(), 0, timeout=2)
        sig = m.signal_window(4)
        m.wait_signal(0, 1, window=sig, stream=s)
        after = cu.event()
        cu.record(after, s)
        m.close()
        del m, sig
        gc.collect()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2 and cu.event_query(after) == fakecuda.NOT_READY:
            time.sleep(0.05)
        print("PASSED THE WAIT" if cu.event_query(after) != fakecuda.NOT_READY else "STILL WAITING")
    """, fake_env())
    assert "STILL WAITING" in p.stdout, p.stdout


def test_a_get_the_target_cannot_copy_down_fails_naming_the_driver_and_keeps_the_pair():
    run_job(2, "get_answer_fails",
            env=fake_env(FLAGCX_MESH_CUDA_PATH="staged", FXM_FAKECUDA_FAIL="cuMemcpyAsync=700"))


def test_a_device_op_done_before_its_peer_left_completes_flush():
    """Rank 0's put waits on a held stream; rank 1 releases it and closes its mesh at once.
    Nothing polls rank 0's device ops meanwhile: when its flush starts, the peer's goodbye is
    already in, but the op is done, and flush must say so (it used to raise PeerLost)."""
    p = run_python("""
        import threading, time, flagcx_mesh as fm, fakecuda
        from meshutil import run_threads
        cu = fakecuda.FakeCuda.get()
        uid = fm.get_unique_id()
        def rank(r):
            m = fm.Mesh(2, uid, r, timeout=10)
            sig = m.signal_window(4)
            win = m.alloc_window(4096, device=0)
            m.barrier(timeout=30)
            if r == 0:
                a = cu.stream()
                m.wait_signal(3, 1, window=sig, stream=a)
                m.put(1, win, 0, win, 0, 4096, stream=a)
                m.barrier(timeout=30)  # rank 1 releases the stream after this, then leaves
                time.sleep(1.0)
                try:
                    m.flush(timeout=10)
                    out = "FLUSHED"
                except fm.MeshError as e:
                    out = f"{type(e).__name__}: {e}"
            else:
                m.barrier(timeout=30)
                m.signal(0, 3, 1, signal_window=sig)
                m.flush(timeout=10)
                out = None
            m.close()
            return out
        print("RANK0", run_threads(2, rank, timeout=60)[0])
    """, fake_env())
    assert "RANK0 FLUSHED" in p.stdout, p.stdout


def test_a_staged_put_landing_slower_than_the_mesh_timeout_fails_it_and_keeps_the_engine():
    run_job(2, "slow_landing", "--mesh-timeout", "3",
            env=fake_env(FLAGCX_MESH_CUDA_PATH="staged",
                         FXM_FAKECUDA_COPY_TO_DEVICE_DELAY_MS="12000"))


def test_compat_window_forms_and_get_on_device_buffers():
    """flagcx.h's window/stream forms on device memory: put_signal_window from an address inside a
    registered device buffer, wait_signals on a stream (slot = the sender's rank), then get."""
    p = run_python("""
        import flagcx_mesh.compat as fc, fakecuda
        from meshutil import run_threads
        cu = fakecuda.FakeCuda.get()
        uid = fc.get_unique_id()
        def rank(r):
            c = fc.comm_init_rank(2, uid, r, timeout=30)
            try:
                src, dst, back = (fakecuda.DeviceBuffer(8192, cu) for _ in range(3))
                c.one_side_register(src)
                w = c.comm_window_register(dst)
                b_idx = c.one_side_register(back)
                c.signal_register(16)
                src.write(bytes([r + 20]) * 8192)
                c.barrier()
                s = cu.stream()
                addr = src.__cuda_array_interface__["data"][0] + 4096
                c.put_signal_window(addr, 1024, fc.flagcxFloat32, 1 - r, w, 0, 0, s)
                c.wait_signals([(1, 1 - r)], s)
                cu.synchronize(s)
                landed = dst.read(4096) == bytes([21 - r]) * 4096
                c.flush(timeout=30)
                c.barrier()
                c.get(1 - r, 0, 0, 4096, w.index, b_idx)
                c.flush(timeout=30)
                c.barrier()
                return landed, back.read(4096) == bytes([r + 20]) * 4096, c.read_signal(8 * (1 - r))
            finally:
                c.destroy()
        print("GOT", run_threads(2, rank, timeout=60))
    """, fake_env())
    assert "GOT [(True, True, 1), (True, True, 1)]" in p.stdout, p.stdout
