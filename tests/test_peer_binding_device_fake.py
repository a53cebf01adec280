"""Invariant 8 for agents' device paths (issue 34, item 2), on the fake CUDA driver: a peer that
hands out descriptors of "its own" region carrying a THIRD agent's IPC handle or fd server (with
that agent's pid, cookie address and cookie, or with its own pid and a seal it forged) never makes
this agent open the third agent's memory (tests/binding_device_prog.py): the pid must hold the
peer's end of this connection, the fd server must be the peer's process (SO_PEERCRED), and a
legacy handle this process opened for the third agent is not opened for another peer process,
not even one that connects under the third agent's name.
Before the fix the victim opened the third agent's allocation and wrote its bytes outside every
region the third agent registered.
"""

from __future__ import annotations

import os

import pytest

import fakecuda
import gpujobs
from meshutil import finish_prog, spawn_prog

pytestmark = pytest.mark.timeout(180)

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "binding_device_prog.py")


def fake_env():
    return gpujobs.job_env(fakecuda.env(granularity=64 << 10),
                           ("FLAGCX_MESH_CUDA_PATH", "FLAGCX_MESH_TRANSPORT", "FXM_FAKECUDA_FAIL"))


def run_roles(tmp_path, roles, envs):
    """Runs the roles at once (the first one ends first, then the others); their outputs."""
    procs = {role: spawn_prog(PROG, role, tmp_path, env=envs.get(role, fake_env()), cwd=HERE, merge=True)
             for role in roles}
    outs = {}
    try:
        for role in roles:
            outs[role] = finish_prog(procs[role], timeout=120, what=role, ok=f"{role} ok")[0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_a_third_agents_ipc_handle_or_fd_server_is_never_opened(tmp_path):
    logged = dict(fake_env(), FLAGCX_MESH_LOG="info")  # the victim logs why each path was refused
    outs = run_roles(tmp_path, ("victim", "peer", "third"), {"victim": logged})
    verdicts = [ln for ln in outs["victim"].splitlines() if ln.startswith("VERDICT")]
    # 4 forged cases x (write, read, path); the impostor named "third" is refused at connect while the
    # third agent lives (its path line then says "-")
    assert len(verdicts) == 14, outs["victim"]
    assert "VERDICT impostor connect refused" in outs["victim"] and "VERDICT impostor path -" in outs["victim"]
    for why in ("field pid: the published pid is not the peer agent's process",  # third-*
                "field IPC handle: agent third",  # own-ipc: this process opened it for the third agent
                "field fd server: it is served by pid"):  # own-vmm: not the peer's process
        assert why in outs["victim"], (why, outs["victim"][-6000:])


def test_every_byte_of_a_device_descriptor_flipped_touches_nothing_outside(tmp_path):
    """cuda-ipc and cuda-vmm regions between guard bytes: every byte of each descriptor flipped,
    a write and a read each; the guards never change, reads bring only the region's bytes."""
    outs = run_roles(tmp_path, ("fuzz", "fuzz-target"), {})
    assert "FUZZ" in outs["fuzz"], outs["fuzz"]
    print(next(ln for ln in outs["fuzz"].splitlines() if ln.startswith("FUZZ")))
