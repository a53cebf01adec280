"""bench notify: an 8-byte write and its notification, ping-pong between two processes, per path;
every slot checked at both ends; NIXL reported NOT RUN with its reason where it is not importable
(the figures themselves are not checked: docs/benchmarks.md, "Notifications")."""

import json
import os
import subprocess
import sys

import pytest

import fakecuda

pytestmark = pytest.mark.timeout(240)

SMALL = ["--iters", "30", "--rounds", "2", "--warmup", "5", "--timeout", "180"]


def bench(tmp_path, *args, env=None):
    out = tmp_path / "notify.json"
    p = subprocess.run([sys.executable, "-m", "flagcx_mesh.bench", "notify", *SMALL, *args, "--json", str(out)],
                       capture_output=True, text=True, timeout=220, env=dict(os.environ, **(env or {})))
    return p, (json.loads(out.read_text()) if out.exists() else None)


def check_row(path, row):
    ours = row["flagcx_mesh"]
    assert ours["path"] == path, row  # the path forced is the path taken
    assert ours["median_us"] > 0 and ours["p99_us"] >= ours["median_us"] and ours["round_trips"] == 60, row
    assert ours["checked"] == "every slot"


def test_host_paths_play_ping_pong_and_nixl_is_measured_or_said_not_run(tmp_path):
    p, fig = bench(tmp_path, "--peers", "nixl")
    assert p.returncode == 0, p.stdout + p.stderr
    assert set(fig["paths"]) == {"cma", "tcp"}
    for path, row in fig["paths"].items():
        check_row(path, row)
        if "error" in row["nixl"]:
            assert "[nixl] NOT RUN:" in p.stdout and row["nixl_over_flagcx_mesh"] is None
        else:
            assert row["nixl"]["median_us"] > 0 and row["nixl_over_flagcx_mesh"] > 0


def test_device_paths_on_the_fake_driver(tmp_path):
    p, fig = bench(tmp_path, "--device", "cuda", "--memory", "driver", "--paths", "cuda-ipc,cuda-vmm",
                   "--peers", "none", env=fakecuda.env(granularity=64 << 10))
    assert p.returncode == 0, p.stdout + p.stderr
    assert set(fig["paths"]) == {"cuda-ipc", "cuda-vmm"}
    for path, row in fig["paths"].items():
        check_row(path, row)


def test_an_unknown_peer_is_refused():
    p = subprocess.run([sys.executable, "-m", "flagcx_mesh.bench", "notify", "--peers", "mooncake"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown peer 'mooncake'" in p.stderr
