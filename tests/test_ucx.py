"""The ucx path (issue 37, csrc/transport/ucx): forced with FLAGCX_MESH_TRANSPORT=ucx over the
libucx wheel's UCX (the [ucx] extra), over UCX's tcp (UCX_TLS=tcp) and its shared memory
(UCX_TLS=sm: posix, sysv, cma) on this host.

- agents in two processes (tests/ucx_prog.py): integrity (random sizes and offsets, single
  writes and batches, every byte read back), order (overlapping writes, the last wins; the
  notification after the data), a target killed mid-batch (PeerLost naming it, no hang);
- two agents in one process: every byte of a ucx region descriptor flipped (invariant 8);
- a 2-rank mesh (tests/onesided_prog.py integrity and ordering) with its windows over ucx;
- the automatic choice's rule (no UCX needed): ucx only for a network transport other than
  tcp that both sides offer;
- a forced ucx that cannot open is an error that names why.
Where UCX cannot be loaded the UCX tests skip saying so, and fail under FXM_REQUIRE_UCX=1
(scripts/test.sh). Every process is bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from flagcx_mesh import _core

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "ucx_prog.py")
PY = sys.executable
pytestmark = pytest.mark.timeout(240)
TLS = ("tcp", "sm")


def ucx_env(tls: str) -> dict:
    env = dict(os.environ)
    env.pop("FLAGCX_MESH_UCX_LIB", None)
    env.update(FLAGCX_MESH_TRANSPORT="ucx", UCX_TLS=tls, UCX_WARN_UNUSED_ENV_VARS="n", PYTHONPATH=HERE)
    if tls == "tcp":
        env["UCX_NET_DEVICES"] = "lo"
    return env


@pytest.fixture(scope="module")
def ucx_info():
    """What UCX this venv loads, asked in a child process (UCX stays out of the test process)."""
    code = "import json, flagcx_mesh._ucx as u; print(json.dumps(u.info()))"
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    info = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else {
        "loaded": False, "error": p.stderr[-2000:]}
    if not info["loaded"]:
        msg = f"UCX could not be loaded here: {info['error']} (pip install 'flagcx_mesh[ucx]')"
        if os.environ.get("FXM_REQUIRE_UCX") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    print(f"UCX {info['version']} from {info['library']}: {', '.join(info['transports'])}")
    return info


def run(args, env, timeout=120, stdin=None):
    try:
        return subprocess.run([PY, PROG, *args], env=env, input=stdin, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"ucx_prog {args} hung past {timeout} s\n{e.stdout}\n{e.stderr}")


class Target:
    """The target process: its first line (metadata, descriptor) is handed to the initiator."""

    def __init__(self, env):
        self.p = subprocess.Popen([PY, PROG, "target"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        self.line = self.p.stdout.readline()
        assert self.line.startswith("{"), f"target: {self.line}{self.finish(10)[1]}"

    def finish(self, timeout):
        try:
            out, err = self.p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            out, err = self.p.communicate()
            return -1, f"the target hung\n{out}\n{err}"
        return self.p.returncode, f"{out}\n{err}"


@pytest.mark.parametrize("tls, error_mode", [("tcp", "peer"), ("sm", "peer"), ("tcp", "auto")])
@pytest.mark.parametrize("scenario", ["integrity", "order"])
def test_agents_over_ucx(ucx_info, tls, error_mode, scenario):
    env = ucx_env(tls)
    env["FLAGCX_MESH_UCX_ERROR_MODE"] = error_mode
    t = Target(env)
    try:
        p = run(["initiator", scenario], env, stdin=t.line)
        assert p.returncode == 0 and f"{scenario} ok" in p.stdout, f"initiator:\n{p.stdout}\n{p.stderr[-6000:]}"
    finally:
        rc, out = t.finish(60)
    assert rc == 0 and "target ok" in out, f"target:\n{out[-6000:]}"


@pytest.mark.parametrize("tls", TLS)
@pytest.mark.parametrize("error_mode", ["peer", "auto"])
def test_target_killed_mid_batch_fails_the_batch_with_peer_lost(ucx_info, tls, error_mode):
    """With UCX's peer error handling and without it (auto, the default, is none here, as
    FLAGCX_MESH_UCX_ERROR_MODE=none would be: no network transport but tcp; the connection's
    loss alone tells, and the endpoint is closed without force)."""
    env = ucx_env(tls)
    env["FLAGCX_MESH_UCX_ERROR_MODE"] = error_mode
    t = Target(env)
    init = subprocess.Popen([PY, PROG, "initiator", "kill"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        init.stdin.write(t.line)
        init.stdin.flush()
        seen = []  # (UCX prints its own log lines to stdout)
        while not seen or seen[-1].strip() not in ("issued", ""):
            seen.append(init.stdout.readline())
        assert seen[-1].strip() == "issued", f"initiator: {''.join(seen)}"
        t.p.send_signal(signal.SIGKILL)
        out, err = init.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        init.kill()
        out, err = init.communicate()
        pytest.fail(f"the initiator hung after the target was killed\n{out}\n{err[-4000:]}")
    finally:
        t.finish(10)
    assert init.returncode == 0 and "kill ok" in out, f"initiator:\n{out}\n{err[-6000:]}"


@pytest.mark.parametrize("tls", TLS)
def test_every_byte_of_a_ucx_descriptor_flipped_touches_nothing_outside(ucx_info, tls):
    p = run(["fuzz"], ucx_env(tls), timeout=200)
    assert p.returncode == 0 and "fuzz ok" in p.stdout, f"{p.stdout}\n{p.stderr[-6000:]}"
    print(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tls", TLS)
@pytest.mark.parametrize("scenario", ["integrity", "ordering"])
def test_mesh_windows_over_ucx(ucx_info, tls, scenario):
    env = ucx_env(tls)
    cmd = [PY, "-m", "flagcx_mesh.launch", "-n", "2", "--timeout", "100", "--grace", "1", "--",
           PY, os.path.join(HERE, "onesided_prog.py"), scenario, "--deadline", "90"]
    try:
        p = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, timeout=130)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the mesh job hung\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"{p.stdout[-6000:]}\n{p.stderr[-6000:]}"
    assert "modes user=ucx alloc=ucx signal=shm" in p.stdout, p.stdout[-3000:]
    for r in range(2):
        assert f"OK rank {r} {scenario} (ucx)" in p.stdout, p.stdout[-3000:]


def test_forced_ucx_that_cannot_open_names_why(tmp_path):
    """A libucp that does not exist: the registration or op fails naming the library asked for."""
    env = ucx_env("tcp")
    env["FLAGCX_MESH_UCX_LIB"] = str(tmp_path / "libucp-missing.so.0")
    code = """
import numpy as np
from flagcx_mesh import MeshError
from flagcx_mesh.agent import Agent
with Agent("t", "s", timeout=10) as b, Agent("i", "s", timeout=10) as a:
    r = b.register(np.zeros(4096, np.uint8))
    c = a.connect(b.metadata(), timeout=10)
    src = a.register(np.zeros(4096, np.uint8))
    try:
        c.write(src, r, 4096).wait(10)
        print("WROTE", c.path_to(r))
    except MeshError as e:
        print("REFUSED", type(e).__name__, e)
"""
    p = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "REFUSED InvalidArgument" in p.stdout, f"{p.stdout}\n{p.stderr[-3000:]}"
    assert "FLAGCX_MESH_TRANSPORT=ucx" in p.stdout and "libucp-missing.so.0" in p.stdout, p.stdout


PATH_PROG = """
import numpy as np
from flagcx_mesh import MeshError
from flagcx_mesh.agent import Agent
with Agent("t", "s", timeout=10) as b, Agent("i", "s", timeout=10) as a:
    r = b.register(np.zeros(4096, np.uint8))
    c = a.connect(b.metadata(), timeout=10)
    try:
        print("PATH", c.path_to(r))
    except MeshError as e:
        print("REFUSED", type(e).__name__, e)
"""


def path_between_two_agents(env):
    """Two agents in a child process: "PATH <path>" the path a host region takes between them, or
    "REFUSED <error> <message>"."""
    return subprocess.run([PY, "-c", PATH_PROG], env=env, capture_output=True, text=True, timeout=60)


def test_a_bad_ucx_error_mode_is_refused_naming_it(ucx_info):
    env = ucx_env("tcp")
    env["FLAGCX_MESH_UCX_ERROR_MODE"] = "sometimes"
    p = path_between_two_agents(env)
    assert "REFUSED InvalidArgument" in p.stdout, f"{p.stdout}\n{p.stderr[-3000:]}"
    assert "FLAGCX_MESH_UCX_ERROR_MODE=sometimes is not one of auto, peer, none" in p.stdout, p.stdout


@pytest.mark.parametrize("mode, want", [(None, "the connection's loss"), ("auto", "the connection's loss"),
                                        ("none", "the connection's loss"), ("peer", "UCX's peer error handling")])
def test_the_error_mode_follows_the_transport_unless_set(ucx_info, mode, want):
    """auto (the default) takes UCX's peer error handling only where the pair shares a network
    transport other than tcp (there UCX keeps its zero-copy puts with it); over UCX's tcp it would
    make UCX emulate puts at about half the rate, so a dead peer is left to the connection's loss.
    The path's choice, logged at info, says which."""
    env = ucx_env("tcp")
    env.pop("FLAGCX_MESH_UCX_ERROR_MODE", None)
    env["FLAGCX_MESH_LOG"] = "info"
    if mode is not None:
        env["FLAGCX_MESH_UCX_ERROR_MODE"] = mode
    p = path_between_two_agents(env)
    assert "PATH ucx" in p.stdout, f"{p.stdout}\n{p.stderr[-3000:]}"
    chosen = [line for line in p.stderr.splitlines() if "over ucx" in line]
    assert chosen and f"a dead peer: {want})" in chosen[0], p.stderr[-3000:]


@pytest.mark.parametrize("mode, fabric, want", [
    (None, True, True), (None, False, False), ("auto", True, True), ("auto", False, False),
    ("peer", True, True), ("peer", False, True), ("none", True, False), ("none", False, False)])
def test_peer_error_handling_is_taken_over_a_fabric_unless_set(monkeypatch, mode, fabric, want):
    if mode is None:
        monkeypatch.delenv("FLAGCX_MESH_UCX_ERROR_MODE", raising=False)
    else:
        monkeypatch.setenv("FLAGCX_MESH_UCX_ERROR_MODE", mode)
    assert _core._ucx_peer_error_handling(fabric) is want


@pytest.mark.parametrize("mine, theirs, want", [
    (["self/memory", "tcp/eth0", "sysv/memory", "posix/memory", "cma/memory"], ["tcp/eth0", "cma/memory"], ""),
    (["tcp/eth0", "rc_mlx5/mlx5_0:1", "ud_verbs/mlx5_0:1"], ["rc_mlx5/mlx5_2:1", "tcp/eth1"], "rc_mlx5"),
    (["tcp/eth0", "rc_mlx5/mlx5_0:1"], ["tcp/eth0", "cuda_ipc/cuda", "cuda_copy/cuda"], ""),
    (["dc_mlx5/mlx5_0:1", "rc_verbs/mlx5_0:1"], ["rc_verbs/mlx5_1:1"], "rc_verbs"),
    ([], ["rc_mlx5/mlx5_0:1"], ""),
])
def test_automatic_choice_takes_ucx_only_for_a_common_network_transport(mine, theirs, want):
    assert _core._ucx_common_network_transport(mine, theirs) == want


@pytest.mark.parametrize("tls, cuda", [
    (["self/memory", "tcp/eth0", "sysv/memory", "cma/memory"], ""),
    (["tcp/lo", "cuda_copy/cuda", "cuda_ipc/cuda", "sysv/memory"], "cuda_copy,cuda_ipc"),
    (["rc_mlx5/mlx5_0:1", "gdr_copy/gdr_copy", "cuda_copy/cuda", "cuda_copy/cuda"], "gdr_copy,cuda_copy"),
    ([], ""),
])
def test_device_memory_goes_to_ucx_only_where_it_offers_a_cuda_transport(tls, cuda):
    assert _core._ucx_device_memory_transports(tls) == cuda


@pytest.mark.parametrize("mode", ["forced", "automatic"])
def test_device_memory_on_ucx_without_a_cuda_transport(ucx_info, mode):
    """Fake-driver device regions (the CPU cannot touch them, and this UCX has no cuda transport):
    FLAGCX_MESH_TRANSPORT=ucx takes device memory too, so each pair with device memory on either
    side is refused naming why (it used to take cuda-self, ignoring the forced transport);
    automatic selection keeps cuda-self and never hands the device region to UCX."""
    import fakecuda
    if "cuda_copy" in ",".join(ucx_info["transports"]):
        pytest.skip("this UCX offers cuda transports: device memory would go to it")
    env = ucx_env("tcp")
    env.update(fakecuda.env())
    if mode == "automatic":
        env.pop("FLAGCX_MESH_TRANSPORT")
        env["FLAGCX_MESH_UCX_LIB"] = ucx_info["library"].split(" (")[0]
    p = run(["device-fake"], env, timeout=120)
    assert p.returncode == 0 and "device-fake ok" in p.stdout, f"{p.stdout}\n{p.stderr[-6000:]}"
