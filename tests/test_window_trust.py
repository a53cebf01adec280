"""A peer's window description is checked against what this rank can see for itself (issue 17,
items 1 and 2; issue 34, item 1: shm): memory outside every window is never reached through it.

Rank 2 of three misbehaves (tests/window_trust_prog.py): it publishes, for window #1,
  - rank 1's cma identity (pid, cookie address, cookie, host, PID namespace) with the address of
    rank 1's private bytes: the pid is not rank 2's process (it holds no end of rank 0's
    connection to rank 2), so rank 0 takes no cma path to it;
  - rank 1's legacy IPC handle with the offset of rank 1's private bytes (fake CUDA driver): the
    handle is rank 1's export, so rank 0 opens no IPC path with it;
  - rank 0's own pid with an address past rank 0's device window (fake driver): no window of
    this process is registered there, so rank 0 takes no cuda-self path;
  - its own IPC handle with a window running past the end of the allocation (fake driver): the
    driver's size of the opened allocation refuses it;
  - its own cuMem fd (served as the library serves them) for a window twice the size of its one
    mapping (fake driver): the mappings must cover the window.
Each time rank 0's get and put to rank 2 go over tcp or staged instead, where rank 2 has no such
window: both fail with a MeshError naming peer 2, and no private byte is read or overwritten.
Before the fix rank 0 read and overwrote the private bytes (cma, ipc, self) with no error, and
took cuda-ipc and cuda-vmm to the windows that run past their memory.
"""

from __future__ import annotations

import os
import subprocess

import pytest

import fakecuda
import gpujobs
from meshutil import PY, subprocess_env

pytestmark = pytest.mark.timeout(240)

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "window_trust_prog.py")
DROP = ("FLAGCX_MESH_CUDA_PATH", "FLAGCX_MESH_TRANSPORT", "FXM_FAKECUDA_FAIL", "FXM_FAKECUDA_NO_STREAM_MEMOPS")


def run_scenario(scenario: str, device: bool) -> str:
    env = gpujobs.job_env(fakecuda.env(granularity=64 << 10) if device else {}, DROP)
    cmd = [PY, "-m", "flagcx_mesh.launch", "-n", "3", "--timeout", "150", "--", PY, PROG, scenario]
    try:
        p = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, timeout=200)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{scenario}: the job hung\n{e.stdout}\n{e.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{scenario}: exit {p.returncode}\n{out[-8000:]}"
    for r in range(3):
        assert f"OK rank {r}" in p.stdout, out[-8000:]
    return out


def check_nothing_reached(out: str, refused_path: str, reason: str) -> None:
    lines = [ln.split("] ", 1)[-1] for ln in out.splitlines()]
    describe = next(ln for ln in lines if ln.startswith("DESCRIBE"))
    peer2 = describe.split("peer 2 ", 1)[1]
    assert not peer2.startswith(refused_path) and reason in peer2, describe
    for op in ("get", "put"):
        verdict = next(ln for ln in lines if ln.startswith(f"VERDICT {op} "))
        assert "succeeded" not in verdict and "peer 2" in verdict, verdict
    assert "VERDICT get read 0 private bytes" in lines, out[-6000:]
    for r in (0, 1):
        assert f"VERDICT rank {r}: 0 private bytes overwritten" in lines, out[-6000:]


def test_a_rank_republishing_another_ranks_cma_identity_reaches_no_memory():
    out = run_scenario("cma", device=False)
    check_nothing_reached(out, "cma", "the published pid is not rank 2's process")


def test_a_rank_publishing_another_ranks_ipc_handle_reaches_no_memory():
    out = run_scenario("ipc", device=True)
    check_nothing_reached(out, "cuda-ipc", "rank 2 published an export rank 1 published")


def test_a_rank_claiming_this_process_pid_gets_no_cuda_self_path():
    out = run_scenario("self", device=True)
    check_nothing_reached(out, "cuda-self", "rank 2 names this process but no window #1 of it")


def test_an_ipc_window_past_the_end_of_its_allocation_is_refused():
    out = run_scenario("ipc-past", device=True)
    check_nothing_reached(out, "cuda-ipc", "does not lie inside the allocation its IPC handle opens")


def test_a_vmm_window_larger_than_its_mappings_is_refused():
    out = run_scenario("vmm-past", device=True)
    check_nothing_reached(out, "cuda-vmm", "the mappings end 65536 bytes after the window's base, before its end")


def test_a_rank_naming_another_jobs_shm_segment_reaches_no_memory():
    """Issue 34, item 1: rank 2 publishes a shm window whose segment is a file of /dev/shm that
    rank 1 created and maps (its bytes are the private ones), with rank 2's own pid and a seal
    of it: rank 2's process maps no such file at the described address, so rank 0 maps nothing.
    Before the fix rank 0 mapped the file: its get copied the file, its put overwrote it."""
    out = run_scenario("shm", device=False)
    check_nothing_reached(out, "shm", "is not rank 2's segment")
