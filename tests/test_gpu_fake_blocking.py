"""A blocking device put (put, then flush) on the fake CUDA driver: what it costs in driver calls
(counted by the fake, never timed), no cross-stream wait on a pair with nothing in flight, FIFO
across streams while something is, a flush's deadline while a copy cannot finish, and a failed
copy still failing flush. See docs/gpu.md, "Where the time of a blocking put goes".
"""

from __future__ import annotations

import json

import pytest

from test_gpu_fake import fake_env, run_python

pytestmark = pytest.mark.timeout(180)

COUNTED = ("cuMemcpyAsync", "cuEventRecord", "cuEventQuery", "cuEventCreate", "cuStreamWaitEvent",
           "cuLaunchHostFunc", "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize",
           "cuStreamCreate")


def counts_of(code: str, env=None) -> dict:
    """Runs code (which prints COUNTS <json of {label: {entry point: calls}}>) and returns the json."""
    p = run_python(code, env or fake_env())
    line = [x for x in p.stdout.splitlines() if x.startswith("COUNTS ")]
    assert line, p.stdout + p.stderr
    return json.loads(line[0][len("COUNTS "):])


# Runs body() n times on one rank (a put to itself: cuda-self), counting the driver calls.
COUNTING = """
    import json, flagcx_mesh as fm, fakecuda
    cu = fakecuda.FakeCuda.get()
    NAMES = %r
    N = 20
    out = {}
    def count(label, body):
        body()  # warm-up: the pair's stream, pooled events
        before = {n: cu.calls(n) for n in NAMES}
        for i in range(N):
            body(i)
        out[label] = {n: cu.calls(n) - before[n] for n in NAMES}
""" % (COUNTED,)


def test_a_blocking_device_put_costs_one_copy_one_event_and_no_sync_wait_or_host_function():
    c = counts_of(COUNTING + """
    with fm.Mesh(1, fm.get_unique_id(), 0, timeout=10) as m:
        w = m.alloc_window(8192, device=0)
        sig = m.signal_window(4)
        def put(i=0):
            m.put(0, w, 0, w, 4096, 8)
            m.flush(timeout=10)
        def put_signal(i=0):
            m.put_signal(0, w, 0, w, 4096, 8, 1, signal_window=sig)
            m.flush(timeout=10)
        count("put", put)
        count("put_signal", put_signal)
    print("COUNTS", json.dumps(out))
    """)
    n = 20
    for label in ("put", "put_signal"):
        got = c[label]
        assert got["cuMemcpyAsync"] == n, (label, got)
        assert got["cuEventRecord"] == n, (label, got)  # the op's completion (and the pair's fence)
        for never in ("cuEventCreate", "cuStreamCreate", "cuStreamWaitEvent", "cuStreamSynchronize",
                      "cuEventSynchronize", "cuCtxSynchronize"):
            assert got[never] == 0, (label, never, got)
    assert c["put"]["cuLaunchHostFunc"] == 0, c  # a plain put is polled by its waiter: no hand-off
    assert c["put"]["cuEventQuery"] >= n, c
    assert c["put_signal"]["cuLaunchHostFunc"] == n, c  # the signal is applied from the stream


def test_ops_on_alternating_streams_to_an_idle_pair_wait_for_nothing_on_the_device():
    """Each op is flushed before the next: the pair has nothing in flight, so an op on another
    stream than the previous one needs no cuStreamWaitEvent (it used to get one every time)."""
    c = counts_of(COUNTING + """
    with fm.Mesh(1, fm.get_unique_id(), 0, timeout=10) as m:
        w = m.alloc_window(8192, device=0)
        sig = m.signal_window(4)
        a, b = cu.stream(), cu.stream()
        def put(i=0):
            m.put(0, w, 0, w, 4096, 8, stream=a if i % 2 else b)
            m.flush(timeout=10)
        def signal(i=0):
            m.signal(0, 1, 1, signal_window=sig, stream=a if i % 2 else b)
            m.flush(timeout=10)
        count("put", put)
        count("signal", signal)
    print("COUNTS", json.dumps(out))
    """)
    assert c["put"]["cuStreamWaitEvent"] == 0, c
    assert c["signal"]["cuStreamWaitEvent"] == 0, c
    assert c["put"]["cuMemcpyAsync"] == 20, c


HELD = """
    import threading, flagcx_mesh as fm, fakecuda
    from meshutil import run_threads
    cu = fakecuda.FakeCuda.get()
    uid = fm.get_unique_id()
"""


def test_a_put_on_another_stream_still_lands_after_the_pairs_op_in_flight():
    """Rank 0's stream a is held by a stream wait; put(0x11) on a, then put(0x22) to the same place
    on stream b: FIFO per pair across streams says 0x22 lands last (b waits for a on the device)."""
    p = run_python(HELD + """
    def rank(r):
        with fm.Mesh(2, uid, r, timeout=30) as m:
            sig = m.signal_window(4)
            one, two, dst = fakecuda.DeviceBuffer(4096), fakecuda.DeviceBuffer(4096), fakecuda.DeviceBuffer(4096)
            one.write(b"\\x11" * 4096)
            two.write(b"\\x22" * 4096)
            w1, w2, wd = m.register_window(one), m.register_window(two), m.register_window(dst)
            m.barrier(timeout=30)
            out = None
            if r == 0:
                a, b = cu.stream(), cu.stream()
                m.wait_signal(3, 1, window=sig, stream=a)  # a is held until rank 1 releases it
                waits = cu.calls("cuStreamWaitEvent")
                m.put(1, w1, 0, wd, 0, 4096, stream=a)
                m.put(1, w2, 0, wd, 0, 4096, stream=b)
                out = cu.calls("cuStreamWaitEvent") - waits
                m.flush(timeout=30)
            else:
                release = threading.Timer(1.0, lambda: m.signal(0, 3, 1, signal_window=sig))
                release.start()
                release.join()
            m.barrier(timeout=30)
            if r == 1:
                data = dst.read()
                out = "0x22" if data == b"\\x22" * 4096 else "0x11" if data == b"\\x11" * 4096 else "mixed"
            m.barrier(timeout=30)
            return out
    print("RESULT", run_threads(2, rank, timeout=60))
    """, fake_env())
    assert "RESULT [1, '0x22']" in p.stdout, p.stdout


def test_a_flush_of_a_copy_held_on_its_stream_fails_at_its_deadline_naming_the_peer():
    p = run_python(HELD + """
    def rank(r):
        with fm.Mesh(2, uid, r, timeout=30) as m:
            sig = m.signal_window(4)
            w = m.alloc_window(4096, device=0)
            m.barrier(timeout=30)
            out = None
            if r == 0:
                a = cu.stream()
                m.wait_signal(3, 1, window=sig, stream=a)
                m.put(1, w, 0, w, 0, 4096, stream=a)
                try:
                    m.flush(1, timeout=1.5)
                    out = "flushed while held"
                except fm.MeshError as e:
                    out = type(e).__name__ + ": " + str(e)
                m.barrier(timeout=30)
                m.flush(timeout=30)  # released now: the put completes
            else:
                m.barrier(timeout=30)
                m.signal(0, 3, 1, signal_window=sig)
            m.barrier(timeout=30)
            return out
    print("RESULT", run_threads(2, rank, timeout=60)[0])
    """, fake_env())
    assert "RESULT MeshTimeout" in p.stdout and "peer 1" in p.stdout, p.stdout


def test_a_copy_that_fails_on_its_stream_fails_a_blocking_flush_every_time():
    p = run_python("""
        import flagcx_mesh as fm, fakecuda
        cu = fakecuda.FakeCuda.get()
        with fm.Mesh(1, fm.get_unique_id(), 0, timeout=10) as m:
            w = m.alloc_window(8192, device=0)
            for i in range(3):
                m.put(0, w, 0, w, 4096, 8)
                try:
                    m.flush(timeout=10)
                    print("FLUSHED")
                except fm.MeshError as e:
                    print("ERROR", e)
    """, fake_env(FXM_FAKECUDA_FAIL="cuEventQuery=700"))
    lines = p.stdout.splitlines()
    assert len(lines) == 3 and all(x.startswith("ERROR ") and "CUDA_ERROR_ILLEGAL_ADDRESS" in x for x in lines), p.stdout
