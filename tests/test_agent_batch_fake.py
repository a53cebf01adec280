"""An agent call's device copies issued together (transport/cuda/copy_batch.h) on the fake CUDA
driver, whose copy kernel (transport/cuda/copy_kernel.h) and cuMemcpyBatchAsync run the copies
of one call last to first: one launch (or batch call) and one event for a call of plain device
writes, writes of mixed sizes at unaligned offsets; ops that touch each other's bytes keep their
order (write after write, read after write, write after read, two reads into the same bytes); a
batch on a busy stream waits for it; FLAGCX_MESH_CUDA_BATCH_COPY=off and a refused batch call
copy one op at a time with the same bytes; a kernel that cannot be loaded or launched leaves
batches to cuMemcpyBatchAsync. Each scenario is a process of tests/agent_batch_prog.py; the
same scenarios run with CUDA tensors on a real GPU from scripts/test-gpu.sh."""

from __future__ import annotations

import os

import pytest

import fakecuda
import gpujobs
from meshutil import finish_prog, spawn_prog

pytestmark = pytest.mark.timeout(120)

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "agent_batch_prog.py")


def run(scenario, **extra):
    env = gpujobs.job_env(fakecuda.env(granularity=64 << 10),
                          ("FLAGCX_MESH_CUDA_PATH", "FLAGCX_MESH_CUDA_BATCH_COPY", "FXM_FAKECUDA_FAIL"), **extra)
    p = spawn_prog(PROG, scenario, "--timeout", 20, env=env, cwd=HERE)
    out, err = finish_prog(p, timeout=90, what=scenario, ok=f"{scenario} ok")
    return out + err


@pytest.mark.parametrize("how", ["kernel", "driver"])
@pytest.mark.parametrize("scenario", ["batched", "mixed", "overlap", "stream"])
def test_one_call_of_device_copies(scenario, how):
    run(scenario, FLAGCX_MESH_CUDA_BATCH_COPY="auto" if how == "kernel" else "driver")


@pytest.mark.parametrize("fail", ["cuLaunchKernel=719@2", "cuLaunchKernel=719", "cuModuleLoadData=218"])
def test_a_kernel_that_cannot_run_leaves_batches_to_the_driver(fail):
    """@2: the warm-up launch (when the path is set up) works, the first batch's fails."""
    out = run("no-kernel", FXM_FAKECUDA_FAIL=fail, FLAGCX_MESH_LOG="info")
    if fail.endswith("@2"):
        assert "launching the copy kernel for 32 device copies failed" in out, out
        assert out.count("launching the copy kernel") == 1, out  # said once
    else:
        assert "loading the copy kernel on device 0" in out and "cuMemcpyBatchAsync" in out, out
        assert out.count("loading the copy kernel") == 1, out


def test_a_run_the_kernel_cannot_reach_goes_through_the_driver_batch():
    """Memory of another device than the one copying: not the kernel, one cuMemcpyBatchAsync for
    the run rather than a cuMemcpyAsync per copy."""
    run("cross-device", FXM_FAKECUDA_DEVICES="2")


def test_batch_copies_off_copy_one_op_at_a_time():
    run("off", FLAGCX_MESH_CUDA_BATCH_COPY="off")


def test_a_refused_batch_call_falls_back_to_one_copy_per_op_and_says_so():
    out = run("refused", FXM_FAKECUDA_FAIL="cuMemcpyBatchAsync=801", FLAGCX_MESH_CUDA_BATCH_COPY="driver")
    assert "cuMemcpyBatchAsync of 32 device copies failed" in out and "one at a time" in out, out
    assert out.count("cuMemcpyBatchAsync of") == 1, out  # said once
