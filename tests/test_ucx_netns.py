"""The ucx path across two "hosts" (issue 37): two network namespaces joined by a veth pair, as
tests/test_netns.py makes them; agents in each, FLAGCX_MESH_TRANSPORT=ucx over UCX's tcp on the
veth pair only (UCX_NET_DEVICES). Needs root and `ip netns` (FXM_REQUIRE_NETNS=1 fails instead of
skipping) and UCX (tests/test_ucx.py's ucx_info). A serial file run alone (tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess

import pytest

import netns_hosts

from test_ucx import PROG, PY, ucx_env, ucx_info  # noqa: F401 (ucx_info: the fixture)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, as tests/test_netns.py makes them:
    {"A": (netns, ifname, address), "B": ...}; removed afterwards."""
    yield from netns_hosts.two_hosts("fu", ("198.51.100.41", "198.51.100.42"))


@pytest.mark.parametrize("scenario", ["integrity", "order"])
def test_agents_across_two_netns_hosts_over_ucx_tcp(ucx_info, two_hosts, scenario):
    """The target in one namespace, the initiator in the other: UCX's tcp over the veth pair only."""
    def env_on(host):
        ns, ifname, _ = two_hosts[host]
        env = ucx_env("tcp")
        env.update(UCX_NET_DEVICES=ifname, FLAGCX_MESH_IFNAME=ifname)
        return env, ["ip", "netns", "exec", ns]
    env_b, in_b = env_on("B")
    target = subprocess.Popen([*in_b, PY, PROG, "target"], env=env_b, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = target.stdout.readline()
        assert line.startswith("{"), f"target: {line}"
        env_a, in_a = env_on("A")
        try:
            p = subprocess.run([*in_a, PY, PROG, "initiator", scenario], env=env_a, input=line,
                               capture_output=True, text=True, timeout=150)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"the initiator hung\n{e.stdout}\n{e.stderr}")
        assert p.returncode == 0 and f"{scenario} ok" in p.stdout, f"{p.stdout}\n{p.stderr[-6000:]}"
        out, err = target.communicate(timeout=60)
        assert target.returncode == 0 and "target ok" in out, f"{out}\n{err[-4000:]}"
    finally:
        if target.poll() is None:
            target.kill()
            target.communicate()
