"""Runs of a write_blocks / read_blocks table on the fake CUDA driver (tests/agent_runs_prog.py):
ops naming the same remote descriptor and local window as the plain device copy before them are
only queued after it (agent/connection.cc), and every boundary of such a run behaves as any op
does: a change of local or remote region (in stretches, or at every row), of the local region's
device, host ops and device ops with a host end in between, an op touching bytes an earlier one
of the run wrote (the batch is cut there), copies within one buffer registered by both agents, a
bad row in the middle of a run (the call refused naming it, nothing moved), and a copy the
driver refuses (the copies before it land, those from it on go to the fallback). Every byte of
every buffer is checked against the call's ops played in order."""

from __future__ import annotations

import os

import pytest

import fakecuda
import gpujobs
from meshutil import finish_prog, spawn_prog

pytestmark = pytest.mark.timeout(120)

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "agent_runs_prog.py")


def run(scenario, **extra):
    env = gpujobs.job_env(fakecuda.env(), ("FLAGCX_MESH_CUDA_PATH", "FLAGCX_MESH_CUDA_BATCH_COPY", "FXM_FAKECUDA_FAIL",
                                           "FLAGCX_MESH_TRANSPORT"), **extra)
    p = spawn_prog(PROG, scenario, "--timeout", 20, env=env, cwd=HERE)
    out, err = finish_prog(p, timeout=90, what=scenario, ok=f"{scenario} ok")
    return out + err


@pytest.mark.parametrize("scenario", ["switch", "alternate", "overlap", "hulls", "refused"])
def test_runs_of_a_table(scenario):
    run(scenario)


def test_a_run_from_another_device_between_runs():
    run("devices", FXM_FAKECUDA_DEVICES="2")


def test_a_run_to_another_device_after_a_run_issues_the_first_on_a_live_stream():
    out = run("remote-devices", FXM_FAKECUDA_DEVICES="2")
    assert "go over" not in out, out


@pytest.mark.parametrize("host", ["cma", "tcp"])
def test_a_run_cut_by_host_ops(host):
    run("interrupted", **({"FLAGCX_MESH_TRANSPORT": "tcp"} if host == "tcp" else {}))


def test_a_copy_the_driver_refuses_in_a_later_run():
    out = run("fallback", FLAGCX_MESH_CUDA_BATCH_COPY="off", FXM_FAKECUDA_FAIL="cuMemcpyAsync=801@31:1")
    assert "30 op(s) go over staged" in out, out


def test_a_copy_the_driver_refuses_in_a_later_run_and_staged_too():
    out = run("fallback-fails", FLAGCX_MESH_CUDA_BATCH_COPY="off", FXM_FAKECUDA_FAIL="cuMemcpyAsync=801@31")
    assert "30 op(s) go over staged" in out, out
    assert "the call failed" in out, out
