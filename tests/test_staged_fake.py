"""Staged device traffic and its deadlines on the fake CUDA driver (issue 17, items 6 and the
batch's one deadline): the jobs of tests/staged_traffic_prog.py and tests/deadline_prog.py as
processes under the launcher, every device window forced to staged. The same traffic at its
full sizes runs on a real GPU from scripts/test-gpu.sh.
"""

from __future__ import annotations

import re

import pytest

import gpujobs
from test_gpu_fake import fake_env

pytestmark = pytest.mark.timeout(240)

JOB_TIMEOUT = 150


def run_job(n, prog, scenario, *args, env):
    return gpujobs.run_job(n, scenario, *args, env=env, device="fake", timeout=JOB_TIMEOUT, prog=prog)


def test_four_ranks_of_random_staged_traffic_on_two_threads_each_move_every_byte():
    """4 ranks x 2 threads, puts / put_signals / batch_puts of 1 B .. 256 KiB with and without
    streams, all to all: every byte of every target window and every signal slot as planned."""
    p = run_job(4, "staged_traffic_prog.py", "staged_traffic", "--max-size", str(256 << 10), "--ops", "24",
                env=fake_env(FLAGCX_MESH_CUDA_PATH="staged"))
    m = re.search(r"staged_traffic: 4 ranks x 2 threads, (\d+) ops, (\d+) bytes put .* (\d+) bytes checked", p.stdout)
    assert m and int(m.group(3)) == 4 * 4 * 2 * (512 << 10), p.stdout[-3000:]


def test_a_batch_put_shares_one_deadline_among_its_entries():
    """Each entry is staged through a copy out of device memory of 2 s, the mesh timeout is 3 s:
    the batch fails with MeshTimeout during its second entry, with the first landed (when
    each entry took a timeout of its own, all three landed and the batch returned after 6 s)."""
    run_job(2, "deadline_prog.py", "batch_deadline", "--mesh-timeout", "3",
            env=fake_env(FLAGCX_MESH_CUDA_PATH="staged", FXM_FAKECUDA_COPY_FROM_DEVICE_DELAY_MS="2000"))


def test_staged_puts_freed_while_host_functions_complete_ops_do_not_deadlock_the_engine():
    """The H200 hang of 4 ranks of staged traffic (issue 17, item 6): the progress thread freed a
    sent staging buffer (cuMemHostUnregister, once more than the pool keeps are live) while it
    held the engine's lock, and the driver's cuMemHostUnregister waits for the host function
    running on its callback thread, which completed a stream op and waited for that lock: the
    rank acknowledged nothing more, and every peer's flush to it timed out. The fake driver's
    cuMemHostUnregister waits for running host functions the same way. Entries up to 8 MiB
    keep more staging buffers of one size live than the pool keeps, 2 ranks make a put_signal
    to itself (cuda-self: a host function) common, and an unpinning of 1 ms per MiB widens the
    window."""
    for seed in range(1, 4):  # three jobs of other traffic (the code before the fix hung in the first)
        p = run_job(2, "staged_traffic_prog.py", "staged_traffic", "--max-size", str(8 << 20), "--ops", "150",
                    "--seed", str(seed), "--mesh-timeout", "20", "--round-timeout", "40",
                    env=fake_env(FLAGCX_MESH_CUDA_PATH="staged", FXM_FAKECUDA_HOST_UNREGISTER_US_PER_MIB="1000"))
        assert "staged_traffic: 2 ranks x 2 threads" in p.stdout, (seed, p.stdout[-3000:])
