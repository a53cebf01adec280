"""Waits of the progress engine end at their deadline while other pairs' device ops complete
(issue 17, item 7), on the fake CUDA driver.

Rank 0 puts to rank 1 on a stream held by a stream wait, so that op cannot complete, while a
thread of rank 0 keeps putting to rank 2 on another stream, each op completing soon after. The
flush (or wait_idle, through a host put behind the held op) of the pair with rank 1 must fail
at its deadline while that traffic still runs. Before the fix a waiter past its deadline polled
the device ops and went on waiting for as long as each poll found some op, of any pair,
completed. On the fake driver such a poll rarely finds one (the waiter polls too often), so
this covers the behaviour without reproducing the old loop: it passes on the engine before the
fix too. Ranks are threads of one process (run_threads, bounded); the traffic ends by itself
after 40 s.
"""

from __future__ import annotations

import pytest

from test_gpu_fake import fake_env, run_python

pytestmark = pytest.mark.timeout(180)

HELD_PAIR_PROG = """
    import threading, time, flagcx_mesh as fm, fakecuda
    from meshutil import run_threads
    cu = fakecuda.FakeCuda.get()
    uid = fm.get_unique_id()
    done = threading.Event()
    def traffic(m, dwin, stream, stop):
        end = time.monotonic() + 40.0  # a bound of its own: the old engine waits as long as it runs
        while not stop.is_set() and time.monotonic() < end:
            m.put(2, dwin, 0, dwin, 0, 4096, stream=stream)
    def rank(r):
        with fm.Mesh(3, uid, r, timeout=5) as m:
            sig = m.signal_window(4)
            dwin = m.alloc_window(4096, device=0)
            hwin = m.alloc_window(4096)
            m.barrier(timeout=30)
            out = None
            if r == 0:
                held = cu.stream()
                m.wait_signal(3, 1, window=sig, stream=held)
                m.put(1, dwin, 0, dwin, 0, 4096, stream=held)  # cannot complete until rank 1 signals
                stop = threading.Event()
                t = threading.Thread(target=traffic, args=(m, dwin, cu.stream(), stop), daemon=True)
                t.start()
                time.sleep(0.2)  # (sequencing: the traffic runs)
                try:
                    WAIT
                    out = "returned"
                except fm.MeshError as e:
                    out = type(e).__name__
                out += "; traffic " + ("still running" if t.is_alive() else "over")
                stop.set()
                t.join(60)
                done.set()
            elif r == 1:
                done.wait(90)
                m.signal(0, 3, 1, signal_window=sig)  # releases the held stream
            m.barrier(timeout=90)
            m.flush(timeout=30)
            return out
    print("WAIT", run_threads(3, rank, timeout=150)[0])
"""


@pytest.mark.parametrize("wait", ["m.flush(1, timeout=2)", "m.put(1, hwin, 0, hwin, 0, 8)"],
                         ids=["flush", "wait_idle"])
def test_a_wait_on_one_pair_fails_at_its_deadline_while_other_pairs_complete(wait):
    """flush(1, timeout=2), and a host put to rank 1 queued behind the held device op (it waits
    for the pair to go idle, up to the mesh timeout of 5 s, through wait_idle), fail with
    MeshTimeout while the puts to rank 2 still complete."""
    code = HELD_PAIR_PROG.replace("WAIT", wait, 1)
    p = run_python(code, fake_env(), timeout=170)
    assert "WAIT MeshTimeout; traffic still running" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
