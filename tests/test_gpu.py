"""Device windows on a real NVIDIA GPU (one GPU, ranks as processes sharing it), with torch.

Skipped where torch cannot use CUDA (CI); scripts/test-gpu.sh runs this file, the fake-driver
tests and the GPU benchmarks in one command on a GPU machine. The scenarios are those of
tests/gpu_prog.py with --device torch; the fake-driver runs of the same scenarios are in
tests/test_gpu_fake.py.
"""

from __future__ import annotations

import os
import subprocess

import pytest

import gpujobs
from meshutil import PY

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
JOB_TIMEOUT = 180


def gpu_env(**extra):
    return gpujobs.job_env({}, ("FLAGCX_MESH_CUDA_PATH", "FLAGCX_MESH_CUDA_DRIVER", "PYTORCH_CUDA_ALLOC_CONF"),
                           **extra)


def run_job(n, scenario, *args, env=None, silent=()):
    return gpujobs.run_job(n, scenario, *args, env=env or gpu_env(), device="torch",
                           timeout=JOB_TIMEOUT, silent=silent)


@pytest.mark.parametrize("n", [2, 4])
def test_automatic_paths_move_the_right_bytes(n):
    p = run_job(n, "integrity", "--expect-alloc", "cuda-vmm", "--expect-user", "cuda-ipc")
    assert "modes alloc=cuda-vmm user=cuda-ipc" in p.stdout


@pytest.mark.parametrize("forced, alloc, user", [
    ("cuda-vmm", "cuda-vmm", "staged"),
    ("cuda-ipc", "staged", "cuda-ipc"),
    ("staged", "staged", "staged"),
])
def test_every_path_forced(forced, alloc, user):
    run_job(2, "integrity", "--expect-alloc", alloc, "--expect-user", user, "--ops", "20",
            env=gpu_env(FLAGCX_MESH_CUDA_PATH=forced))


def test_expandable_segments_tensors_go_over_cuda_vmm():
    """64 MiB windows: an expandable-segments tensor that size spans several cuMem mappings
    (20 MiB each), and the puts (8-16 MiB) cross their boundaries."""
    p = run_job(2, "integrity", "--user", "multimap", "--expect-alloc", "cuda-vmm", "--expect-user", "cuda-vmm",
                "--size", str(64 << 20), "--ops", "12",
                env=gpu_env(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"))
    assert "user=cuda-vmm" in p.stdout


@pytest.mark.parametrize("legacy", [False, True])
def test_data_lands_before_its_signal_on_streams(legacy):
    run_job(2, "stream", "--rounds", "300", *(["--legacy-stream"] if legacy else []))


def test_bad_input_is_refused_and_writes_nothing():
    run_job(2, "bad_input")


def test_a_peer_killed_during_a_transfer_is_named():
    run_job(2, "peer_death", silent=(1,))


def test_compat_device_tensors_and_stream_waits():
    run_job(2, "compat")


def test_selftest_on_the_gpu():
    p = subprocess.run([PY, "-m", "flagcx_mesh.selftest", "-n", "4", "--iterations", "3", "--device", "cuda"],
                       env=gpu_env(), cwd=HERE, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "device windows on cuda: every byte checked" in p.stdout and "cuda-vmm" in p.stdout, p.stdout


def test_pd_example_on_the_gpu():
    cmd = [PY, "-m", "flagcx_mesh.launch", "-n", "2", "--timeout", "240", "--",
           PY, os.path.join(REPO, "examples", "pd_kv_transfer.py"), "--device", "cuda", "--rounds", "3"]
    p = subprocess.run(cmd, env=gpu_env(), cwd=HERE, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all 3 round(s) passed" in p.stdout, p.stdout
