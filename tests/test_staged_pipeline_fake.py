"""The pipelined staged path on the fake CUDA driver (issue 20, "staged pipelined"): the jobs of
tests/staged_pipeline_prog.py on 2 ranks, every device window forced to staged, chunks of
64 KiB and an in-flight bound of 256 KiB, so ops of a few hundred KiB cross many chunk
boundaries and wrap their ring of staging buffers. Copies made slow by the fake driver's
delays widen the windows where an op is half sent or half landed.
"""

from __future__ import annotations

import re

import pytest

import gpujobs
from test_gpu_fake import fake_env

pytestmark = pytest.mark.timeout(200)

JOB_TIMEOUT = 90
CHUNK, INFLIGHT = 64 << 10, 256 << 10


def run(scenario, **extra):
    env = fake_env(FLAGCX_MESH_CUDA_PATH="staged", FLAGCX_MESH_STAGED_CHUNK_BYTES=str(CHUNK),
                   FLAGCX_MESH_STAGED_INFLIGHT_BYTES=str(INFLIGHT), **extra)
    return gpujobs.run_job(2, scenario, env=env, device="fake", timeout=JOB_TIMEOUT,
                           prog="staged_pipeline_prog.py")


def test_puts_and_gets_across_chunk_boundaries_at_odd_offsets_move_every_byte():
    """1 B .. 9 chunks + 11 B (one byte either side of chunk boundaries), odd offsets, with and
    without a stream, both directions at once: every put's bytes at the target, every get's."""
    p = run("integrity")
    assert "integrity: 10 puts and gets" in p.stdout, p.stdout[-3000:]


def test_a_signal_after_a_multi_chunk_put_is_seen_only_after_all_its_bytes_landed():
    """Copies up of 3 ms each (4 landing buffers, 8 chunks a put): the target reads the whole
    region as soon as each signal is seen. (With the wait for the copies up removed from the
    put's end, round 1 failed: its signal was seen before byte 327680 of 458757 landed.)"""
    p = run("signal_fifo", FXM_FAKECUDA_COPY_TO_DEVICE_DELAY_MS="3")
    assert "signal_fifo: 6 put_signals" in p.stdout, p.stdout[-3000:]


def test_a_peer_killed_while_multi_chunk_puts_are_sent_fails_the_initiator_naming_it():
    """Copies down of 2 ms a chunk keep rank 0 inside 40-chunk puts (a ring of 4) when rank 1
    dies: rank 0 fails with PeerLost naming peer 1 in under half the mesh timeout."""
    p = run("peer_death", FXM_FAKECUDA_COPY_FROM_DEVICE_DELAY_MS="2")
    m = re.search(r"peer_death: loss seen after (\d+) puts", p.stdout)
    assert m, p.stdout[-3000:]


def test_a_put_whose_first_send_fails_fails_with_peer_lost_at_once():
    """The calling thread sends a put's first bytes itself on an idle connection; where that send
    fails (rank 0's sockets to rank 1 shut for sending, rank 1 stopped: nothing read tells of it),
    the put was dropped unsent and its caller waited for ring slots until its 6 s deadline
    ("timed out with 0 of N bytes sent", seen once in CI as a race of the test above); now it
    fails with PeerLost naming peer 1 in under half of it. One lane: the put is not striped."""
    env = fake_env(FLAGCX_MESH_CUDA_PATH="staged", FLAGCX_MESH_STAGED_CHUNK_BYTES=str(CHUNK),
                   FLAGCX_MESH_STAGED_INFLIGHT_BYTES=str(INFLIGHT), FLAGCX_MESH_TCP_LANES="1")
    p = gpujobs.run_job(2, "first_send_fails", "--mesh-timeout", "6", env=env, device="fake", timeout=JOB_TIMEOUT,
                        prog="staged_pipeline_prog.py")
    assert "first_send_fails: PeerLost after" in p.stdout, p.stdout[-3000:]


def test_many_large_puts_outstanding_hold_no_more_staging_than_the_bound():
    """10 puts of 16 chunks + 1 B back to back to a target whose copies up take 3 ms each: the
    staging rank 0's puts held for peer 1 peaked within FLAGCX_MESH_STAGED_INFLIGHT_BYTES
    (mesh.stats()["staged_bytes_peak"]), and every byte landed."""
    p = run("backpressure", FXM_FAKECUDA_COPY_TO_DEVICE_DELAY_MS="3")
    m = re.search(r"held at most (\d+) B of staging \(bound (\d+)\)", p.stdout)
    assert m and 0 < int(m.group(1)) <= int(m.group(2)) == INFLIGHT, p.stdout[-3000:]


def test_a_put_whose_copy_down_fails_after_its_frame_started_is_cut_short_and_never_signalled():
    """Copies down of 1 s a chunk, a mesh timeout of 3 s: rank 0's 6-chunk put_signal fails with
    MeshTimeout in its third chunk, after its frame started. Its connection is shut, so rank 1
    loses rank 0 at once (not when rank 0 exits, 6 s later) and never applies the signal."""
    env = fake_env(FLAGCX_MESH_CUDA_PATH="staged", FLAGCX_MESH_STAGED_CHUNK_BYTES=str(CHUNK),
                   FLAGCX_MESH_STAGED_INFLIGHT_BYTES=str(INFLIGHT), FXM_FAKECUDA_COPY_FROM_DEVICE_DELAY_MS="1000")
    p = gpujobs.run_job(2, "cut_short", "--mesh-timeout", "3", env=env, device="fake", timeout=JOB_TIMEOUT,
                        prog="staged_pipeline_prog.py")
    assert "rank 1 lost rank 0 after" in p.stdout and "signal not applied" in p.stdout, p.stdout[-3000:]
