"""Get answers are bounded per peer (issue 34, item 6): two readers ask an owner for 160 MiB
each and stop reading (SIGSTOP). The owner holds at most its answer ring per reader
(StagedPayload::kAnswerChunks chunks of FLAGCX_MESH_STAGED_CHUNK_BYTES, 1 MiB by default:
4 MiB), which stats() reports, and its anonymous memory does not grow by the answers' size;
once the readers go on, every byte they read is right. Device memory on the fake CUDA driver
(staged answers: pinned chunks) and host memory (heap chunks)."""

import os
import signal
import time

import pytest

import fakecuda
import gpujobs
from meshutil import finish_prog, proc_state, publish, spawn_prog

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "agent_answer_prog.py")
SIZE = 160 << 20
RING = 4 << 20  # kAnswerChunks (4) chunks of 1 MiB

pytestmark = pytest.mark.timeout(240)


def role_env(kind):
    base = fakecuda.env(granularity=64 << 10) if kind == "device" else {}
    return gpujobs.job_env(base, ("FLAGCX_MESH_CUDA_PATH", "FLAGCX_MESH_TRANSPORT", "FLAGCX_MESH_STAGED_CHUNK_BYTES"),
                           FLAGCX_MESH_TRANSPORT="tcp", FLAGCX_MESH_CUDA_PATH="staged")


@pytest.mark.parametrize("kind", ["host", "device"])
def test_readers_that_stop_reading_hold_at_most_the_answer_ring(tmp_path, kind):
    env = role_env(kind)
    procs = [spawn_prog(PROG, "owner", tmp_path, kind, SIZE, env=env, cwd=HERE)]
    try:
        readers = [spawn_prog(PROG, "reader", tmp_path, f"reader-{k}", SIZE, env=env, cwd=HERE) for k in range(2)]
        procs += readers
        end = time.monotonic() + 120
        while not all(p.poll() is not None or proc_state(p.pid) == "T" for p in readers):
            assert time.monotonic() < end, "the readers never stopped themselves"
            time.sleep(0.01)
        assert all(p.poll() is None for p in readers), [finish_prog(p) for p in readers]
        time.sleep(1.0)  # the owner answers as far as the sockets take
        publish(str(tmp_path), "stopped", b"")
        end = time.monotonic() + 60
        while not os.path.exists(tmp_path / "measured"):
            assert time.monotonic() < end and procs[0].poll() is None, finish_prog(procs[0])
            time.sleep(0.01)
        for p in readers:
            p.send_signal(signal.SIGCONT)
        for p in readers:
            finish_prog(p, timeout=120, ok="reader ok")
        out, _ = finish_prog(procs[0], timeout=60, ok="owner ok")
        line = next(ln for ln in out.splitlines() if ln.startswith("held "))
        _, held, _, peak, _, grew = line.split()
        held, peak, grew = int(held), int(peak), int(grew)
        assert grew < 64 << 20, f"the owner's memory grew by {grew >> 20} MiB for two stopped readers ({line})"
        assert 0 < peak <= RING, line
        assert held <= 2 * RING, line
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.communicate()
