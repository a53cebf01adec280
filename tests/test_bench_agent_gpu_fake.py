"""`python -m flagcx_mesh.bench agent --device cuda` on the fake CUDA driver: the target in a child
process, every device path measured, the bytes checked at the target, staged's references of the
same run (raw loopback TCP; pinned copies need torch) and its ratio to them, a peer that cannot
run reported with its reason (docs/benchmarks.md, "Agents on GPU memory")."""

import json
import os
import subprocess
import sys

import pytest

import fakecuda

pytestmark = pytest.mark.timeout(240)

SMALL = ["--device", "cuda", "--memory", "driver", "--region", "1M", "--blocks", "64K",
         "--count", "8", "--bytes", "1M", "--setups", "1", "--connects", "2", "--timeout", "60"]


def bench(tmp_path, *args):
    env = dict(os.environ, **fakecuda.env(granularity=64 << 10))
    out = tmp_path / "a.json"
    p = subprocess.run([sys.executable, "-m", "flagcx_mesh.bench", "agent", *SMALL, *args, "--json", str(out)],
                       capture_output=True, text=True, timeout=220, env=env, cwd=str(tmp_path))
    return p, (json.loads(out.read_text()) if out.exists() else None)


def test_every_device_path_moves_and_verifies_its_bytes(tmp_path):
    p, fig = bench(tmp_path, "--peers", "none")
    assert p.returncode == 0, p.stdout + p.stderr
    assert set(fig["flagcx_mesh"]) == {"cuda-ipc", "cuda-vmm", "staged"}
    for path, f in fig["flagcx_mesh"].items():
        assert f["verify"] == "ok", (path, f)
        req = f["request"]["64 KiB"]
        assert req["path"] == path, (path, req)  # the path forced is the path taken
        assert req["pipelined_GBps"] > 0 and req["blocking_GBps"] > 0
        assert f["setup"]["register_ms"] > 0 and f["setup"]["connect_median_ms"] > 0
        assert f"[{path}] bytes at the target: ok" in p.stdout
        mesh = req["mesh"]  # the mesh's puts beside the agent: same blocks, same path
        assert mesh["path"] == path and mesh["pipelined_GBps"] > 0 and mesh["blocking_GBps"] > 0, (path, mesh)
        goal = fig["goals"][path]["64 KiB_blocking_GBps_over_mesh_put"]
        assert goal == pytest.approx(req["blocking_GBps"] / mesh["blocking_GBps"]), (path, goal)
    assert fig["goals"]["cuda-vmm"]["register_goal_over_ms"] > 0
    # staged's references of the same run (no pinned copies without torch: raw loopback TCP alone)
    refs = fig["staged_refs"]
    assert refs["tcp_1_lane_GBps"] > 0 and refs["tcp_4_lanes_GBps"] > 0 and refs["pinned_d2h_GBps"] is None
    lanes = fig["flagcx_mesh"]["staged"]["tcp_lanes"]  # the staged connection's (its batches are striped over them)
    assert lanes >= 1 and refs["lanes"] == lanes and refs["tcp_same_lanes_GBps"] > 0
    assert refs["reference_GBps"] == refs["tcp_same_lanes_GBps"]
    assert refs["tcp_same_lanes_rings_GBps"] > 0  # context: the same lanes through rings of distinct bytes
    staged = fig["flagcx_mesh"]["staged"]["request"]["64 KiB"]["pipelined_GBps"]
    assert refs["ratios"]["64 KiB_pipelined_GBps_over_reference"] == pytest.approx(staged / refs["reference_GBps"])
    assert "[staged refs] raw loopback TCP" not in p.stdout and "[staged refs] pinned D2H n/a" in p.stdout
    # where the staged runs waited, both sides (flagcx_mesh.cuda.staged_waits), only for staged
    waits = fig["flagcx_mesh"]["staged"]["request"]["64 KiB"]["staged_waits"]
    assert set(waits) == {"initiator", "target"} and set(waits["target"]) == set(waits["initiator"])
    assert {"slot_waits", "gather_waits", "starved", "landing_waits"} <= set(waits["initiator"])
    assert all(v >= 0 for side in waits.values() for v in side.values()), waits
    assert "8 x 64 KiB, pipelined runs: the filler waited for ring slots" in p.stdout, p.stdout
    assert all("staged_waits" not in fig["flagcx_mesh"][path]["request"]["64 KiB"] for path in ("cuda-ipc", "cuda-vmm"))


def test_mesh_put_off_leaves_the_mesh_out_and_says_so(tmp_path):
    p, fig = bench(tmp_path, "--peers", "none", "--paths", "cuda-ipc", "--mesh-put", "off")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "mesh" not in fig["flagcx_mesh"]["cuda-ipc"]["request"]["64 KiB"]
    assert "[mesh put] NOT RUN: --mesh-put off" in p.stdout
    assert fig["goals"]["cuda-ipc"]["64 KiB_blocking_GBps_over_mesh_put"] is None


def test_a_peer_that_cannot_run_is_reported_not_left_out(tmp_path):
    p, fig = bench(tmp_path, "--peers", "nixl", "--paths", "cuda-ipc")
    assert fig is not None, p.stdout + p.stderr
    nixl = fig["peers"]["nixl"]
    if "error" not in nixl:
        pytest.skip("NIXL runs on this machine's (fake) driver: nothing to report")
    assert nixl["error"] and "[nixl] NOT RUN:" in p.stdout


def test_staged_into_a_host_region_is_measured_beside_staged_with_the_same_references(tmp_path):
    """staged-host: the target's region in host memory (no GPU work in the target process): one
    batch as over staged, every byte checked there, its waits and its ratio to the references
    that staged's were taken from (printed once)."""
    p, fig = bench(tmp_path, "--peers", "none", "--paths", "staged,staged-host", "--mesh-put", "off")
    assert p.returncode == 0, p.stdout + p.stderr
    host = fig["flagcx_mesh"]["staged-host"]
    assert host["verify"] == "ok" and "[staged-host] bytes at the target: ok" in p.stdout, p.stdout
    req = host["request"]["64 KiB"]
    assert req["path"] == "staged" and req["pipelined_GBps"] > 0, req
    assert set(req["staged_waits"]) == {"initiator", "target"}
    refs = fig["staged_refs"]
    want = req["pipelined_GBps"] / refs["reference_GBps"]
    assert refs["ratios_host"]["64 KiB_pipelined_GBps_over_reference"] == pytest.approx(want)
    assert "ratios" in refs and p.stdout.count("[staged refs] pinned D2H") == 1, p.stdout
    assert "[staged refs] staged-host: 8 x 64 KiB: pipelined" in p.stdout, p.stdout


def test_the_staged_target_runs_on_the_gpu_named_and_says_which(tmp_path):
    """--target-gpu N: the staged target's process runs with CUDA_VISIBLE_DEVICES=N (as it reports
    itself), this process keeps its own, each staged line says which GPU each process used; the
    paths and peers that do not run between two GPUs are NOT RUN, said, and the run goes on (the
    fake driver ignores the variable and has no bus id: only the plumbing is checked here)."""
    p, fig = bench(tmp_path, "--peers", "nixl", "--paths", "cuda-ipc,ucx,staged", "--mesh-put", "off",
                   "--target-gpu", "5")
    assert p.returncode == 0, p.stdout + p.stderr
    for path in ("cuda-ipc", "ucx"):
        assert f"[{path}] NOT RUN: --target-gpu 5: only the staged paths" in p.stdout, p.stdout
        assert path not in fig["flagcx_mesh"]
    assert "[nixl] NOT RUN: --target-gpu 5: the peers run on one GPU only" in p.stdout and not fig["peers"]
    gpus = fig["flagcx_mesh"]["staged"]["gpus"]
    assert fig["flagcx_mesh"]["staged"]["verify"] == "ok" and gpus["target_visible_devices"] == "5", gpus
    assert gpus["initiator_visible_devices"] == os.environ.get("CUDA_VISIBLE_DEVICES"), gpus
    assert "[staged] GPUs: this process bus unknown, the target (CUDA_VISIBLE_DEVICES=5) bus unknown" in p.stdout
    p, fig = bench(tmp_path, "--peers", "none", "--paths", "staged", "--mesh-put", "off")
    assert p.returncode == 0, p.stdout + p.stderr
    assert fig["flagcx_mesh"]["staged"]["gpus"]["target_visible_devices"] == os.environ.get("CUDA_VISIBLE_DEVICES")
