"""One op call waits within one deadline, however many things it waits for (issue 17: no call
outlives its deadline), on the fake CUDA driver; ranks are threads of one process.

A host put with a stream, to a pair busy with a device op on a held stream, first waits for the
pair to go idle, then for its own stream. Each wait used to take a fresh op timeout, so the put
could last twice the mesh timeout (and a put_signal or a signal on a stream more).
"""

from __future__ import annotations

import pytest

from test_gpu_fake import fake_env, run_python

pytestmark = pytest.mark.timeout(180)

# Both programs: two ranks as threads; release() sets a signal slot of rank 0 after a while,
# which lets the stream waits queued on it pass.
PRELUDE = """
    import threading, time, flagcx_mesh as fm, fakecuda
    from meshutil import run_threads
    cu = fakecuda.FakeCuda.get()
    uid = fm.get_unique_id()
    def release(m, sig, slot, after):
        time.sleep(after)  # (sequencing)
        m.signal(0, slot, 1, signal_window=sig)
"""

TWO_WAITS_PROG = PRELUDE + """
    def rank(r):
        with fm.Mesh(2, uid, r, timeout=3) as m:
            sig = m.signal_window(4)
            dwin = m.alloc_window(4096, device=0)
            hwin = m.alloc_window(4096)
            m.barrier(timeout=30)
            out = None
            if r == 0:
                held, own = cu.stream(), cu.stream()
                m.wait_signal(3, 1, window=sig, stream=held)
                m.put(1, dwin, 0, dwin, 0, 4096, stream=held)  # the pair is busy on cuda-self until slot 3
                m.wait_signal(2, 1, window=sig, stream=own)  # the host put's stream, until slot 2
                helpers = [threading.Thread(target=release, args=(m, sig, 3, 2.0)),
                           threading.Thread(target=release, args=(m, sig, 2, 4.0))]
                for t in helpers:
                    t.start()
                try:
                    m.put(1, hwin, 0, hwin, 0, 8, stream=own)  # the pair until 2 s, then its stream until 4 s
                    out = "returned"
                except fm.MeshError as e:
                    out = f"{type(e).__name__}: {e}"
                for t in helpers:
                    t.join(30)
            m.barrier(timeout=60)
            m.flush(timeout=30)
            return out
    print("PUT", run_threads(2, rank, timeout=120)[0])
"""


def test_an_op_that_waits_twice_fails_at_one_op_timeout():
    """Mesh timeout 3 s: the pair goes idle at 2 s, the stream gets there at 4 s. The put must
    fail with MeshTimeout waiting for its stream (when each wait took its own timeout, the
    stream wait ended at 5 s and the put returned)."""
    p = run_python(TWO_WAITS_PROG, fake_env(), timeout=150)
    assert "PUT MeshTimeout:" in p.stdout and "stream" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


LOCKED_PAIR_PROG = PRELUDE + """
    def rank(r):
        with fm.Mesh(2, uid, r, timeout=3) as m:
            sig = m.signal_window(4)
            hwin = m.alloc_window(4096)
            m.barrier(timeout=30)
            out = None
            if r == 0:
                held_b, held_a = cu.stream(), cu.stream()
                m.wait_signal(2, 1, window=sig, stream=held_b)  # thread B's stream, until slot 2
                m.wait_signal(3, 1, window=sig, stream=held_a)  # this thread's stream, until slot 3
                def other_thread():  # holds the pair's lock while it waits for its stream (2 s)
                    m.put(1, hwin, 0, hwin, 0, 8, stream=held_b)
                helpers = [threading.Thread(target=release, args=(m, sig, 2, 2.0)),
                           threading.Thread(target=release, args=(m, sig, 3, 4.25)),
                           threading.Thread(target=other_thread)]
                for t in helpers:
                    t.start()
                time.sleep(0.5)  # (sequencing: the other thread holds the pair)
                try:
                    m.put(1, hwin, 8, hwin, 8, 8, stream=held_a)  # the pair until 2 s, then its stream until 4.25 s
                    out = "returned"
                except fm.MeshError as e:
                    out = f"{type(e).__name__}: {e}"
                for t in helpers:
                    t.join(30)
            m.barrier(timeout=60)
            m.flush(timeout=30)
            return out
    print("PUT", run_threads(2, rank, timeout=120)[0])
"""


def test_waiting_for_another_threads_op_to_the_pair_counts_against_the_deadline():
    """Mesh timeout 3 s. Another thread's put to the same pair holds it (waiting for its stream)
    until 2 s; this thread's put, called at 0.5 s, then waits for its own stream until 4.25 s.
    It must fail with MeshTimeout at 3.5 s (when its deadline started once it had the pair, at
    2 s, its stream wait would have ended at 5 s: the put returned)."""
    p = run_python(LOCKED_PAIR_PROG, fake_env(), timeout=150)
    assert "PUT MeshTimeout:" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
