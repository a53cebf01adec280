"""Waits of the progress engine end at their deadline while other pairs' device ops complete
(issue 17, item 7), on the fake CUDA driver.

Rank 0 puts to rank 1 on a stream held by a stream wait, so that op cannot complete. Before it,
rank 0 queued a backlog of device puts to rank 2 behind a gate (a stream wait on its own slot);
then the fake's polls of pending work are made slow (a cuEventQuery answering NOT_READY takes
20 ms) and the gate opens: the backlog completes one op every ~8 ms (slow copies to the device)
for about 12 s. Each poll of the waiter (the held op, then the backlog's next op: at least
40 ms) so finds some op of rank 2 completed. The flush (or wait_idle, through a host put queued
behind the held op) of the pair with rank 1 must fail at its deadline while the backlog still
runs; before the fix a waiter past its deadline went round again after every poll that completed
some op, of any pair, and so waited for the whole backlog. Ranks are threads of one process
(run_threads, bounded); the backlog ends by itself.
"""

from __future__ import annotations

import pytest

from test_gpu_fake import fake_env, run_python

pytestmark = pytest.mark.timeout(240)

HELD_PAIR_PROG = """
    import threading, flagcx_mesh as fm, fakecuda
    from meshutil import run_threads
    cu = fakecuda.FakeCuda.get()
    uid = fm.get_unique_id()
    done = threading.Event()
    BACKLOG = 1500  # ops to rank 2, ~8 ms each once the gate opens
    def rank(r):
        with fm.Mesh(3, uid, r, timeout=5) as m:
            sig = m.signal_window(4)
            dwin = m.alloc_window(4096, device=0)
            hwin = m.alloc_window(4096)
            m.barrier(timeout=30)
            out = None
            if r == 0:
                gated, held = cu.stream(), cu.stream()
                m.wait_signal(2, 1, window=sig, stream=gated)  # the gate: rank 0's own slot 2
                for _ in range(BACKLOG):
                    m.put(2, dwin, 0, dwin, 0, 4096, stream=gated)
                end = cu.event()
                cu.record(end, gated)
                m.wait_signal(3, 1, window=sig, stream=held)
                m.put(1, dwin, 0, dwin, 0, 4096, stream=held)  # cannot complete until rank 1 signals
                cu.set_not_ready_query_delay(0.02)
                m.signal(0, 2, 1, signal_window=sig)  # opens the gate
                try:
                    WAIT
                    out = "returned"
                except fm.MeshError as e:
                    out = type(e).__name__
                out += "; backlog " + ("still running" if cu.event_query(end) != 0 else "over")
                cu.set_not_ready_query_delay(0)
                done.set()
            elif r == 1:
                done.wait(120)
                m.signal(0, 3, 1, signal_window=sig)  # releases the held stream
            m.flush(timeout=60)  # rank 0: once rank 1 released the held op (before anyone closes)
            m.barrier(timeout=120)
            return out
    print("WAIT", run_threads(3, rank, timeout=200)[0])
"""


@pytest.mark.parametrize("wait", ["m.flush(1, timeout=2)", "m.put(1, hwin, 0, hwin, 0, 8)"],
                         ids=["flush", "wait_idle"])
def test_a_wait_on_one_pair_fails_at_its_deadline_while_other_pairs_complete(wait):
    """flush(1, timeout=2), and a host put to rank 1 queued behind the held device op (it waits
    for the pair to go idle, up to the mesh timeout of 5 s, through wait_idle), fail with
    MeshTimeout while rank 2's backlog still completes (before the fix: once it was over)."""
    code = HELD_PAIR_PROG.replace("WAIT", wait, 1)
    p = run_python(code, fake_env(FXM_FAKECUDA_COPY_TO_DEVICE_DELAY_MS="8"), timeout=230)
    assert "WAIT MeshTimeout; backlog still running" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
