"""`python -m flagcx_mesh.bench agent` runs with flagcx_mesh alone (--peers none) and reports a
peer that cannot run instead of leaving it out."""

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SMALL = ["--region", "1M", "--blocks", "64K", "--count", "8", "--churn", "3", "--connects", "3"]


def bench(*args):
    p = subprocess.run([sys.executable, "-m", "flagcx_mesh.bench", "agent", *SMALL, *args],
                       capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_agent_bench_alone_prints_and_saves_every_figure(tmp_path):
    out = bench("--peers", "none", "--transports", "tcp", "--json", str(tmp_path / "a.json"))
    fig = json.loads((tmp_path / "a.json").read_text())
    tcp = fig["flagcx_mesh"]["tcp"]
    assert fig["peers"] == {}
    assert tcp["version"].startswith("flagcx_mesh ")
    assert tcp["setup"]["connect_ms"] > 0 and tcp["setup"]["connect_median_ms"] > 0
    req = tcp["request_64 KiB"]
    assert req["path"] == "tcp" and req["pipelined_GBps"] > 0 and req["blocking_GBps"] > 0
    assert tcp["churn_per_s"] > 0
    assert "[tcp] 8 x 64 KiB over tcp: pipelined" in out and "[tcp] churn:" in out
    mesh = req["mesh"]  # the mesh's own puts beside the agent: same blocks, same path
    assert mesh["path"] == "tcp" and mesh["pipelined_GBps"] > 0 and mesh["blocking_GBps"] > 0
    goal = fig["goals"]["tcp"]["64 KiB_blocking_GBps_over_mesh_put"]
    assert goal == pytest.approx(req["blocking_GBps"] / mesh["blocking_GBps"])
    assert "the mesh's puts beside it over tcp" in out


@pytest.mark.parametrize("transport", ["cma", "shm"])
def test_the_mesh_beside_takes_the_agents_path(tmp_path, transport):
    bench("--peers", "none", "--transports", transport, "--churn", "0", "--json", str(tmp_path / "a.json"))
    req = json.loads((tmp_path / "a.json").read_text())["flagcx_mesh"][transport]["request_64 KiB"]
    assert req["path"] == transport and req["mesh"]["path"] == transport


def test_mesh_put_off_leaves_the_mesh_out_and_says_so(tmp_path):
    out = bench("--peers", "none", "--transports", "tcp", "--churn", "0", "--mesh-put", "off",
                "--json", str(tmp_path / "a.json"))
    fig = json.loads((tmp_path / "a.json").read_text())
    assert "mesh" not in fig["flagcx_mesh"]["tcp"]["request_64 KiB"]
    assert fig["goals"]["tcp"]["64 KiB_blocking_GBps_over_mesh_put"] is None
    assert "[mesh put] NOT RUN: --mesh-put off" in out


@pytest.mark.parametrize("peer,module", [("mooncake", "mooncake"), ("nixl", "nixl")])
def test_a_peer_that_cannot_run_is_reported(tmp_path, peer, module):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here: the bench runs it")
    out = bench("--peers", peer, "--transports", "tcp", "--churn", "0", "--json", str(tmp_path / "a.json"))
    assert f"[{peer}] NOT RUN: ModuleNotFoundError" in out, out
    assert "ModuleNotFoundError" in json.loads((tmp_path / "a.json").read_text())["peers"][peer]["error"]
