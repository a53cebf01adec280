"""The README's examples run as printed: the mesh example (its Python block with Mesh.from_env)
under the embedded launcher, the agent example as two processes."""

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def _run_example(tmp_path, env=None):
    if not os.path.exists(README):
        pytest.skip("README.md is not beside the tests")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", open(README).read(), re.S) if "Mesh.from_env" in b]
    assert blocks, "the README has no mesh example (a Python block with Mesh.from_env)"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    p = subprocess.run([sys.executable, "-m", "flagcx_mesh.launch", "-n", "2", str(script)],
                       capture_output=True, text=True, timeout=80, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.mark.timeout(90)
def test_readme_python_example_runs_without_numpy(tmp_path):
    """It runs right after `pip install .`, which installs no numpy: here numpy cannot be imported."""
    blocker = tmp_path / "no-numpy"
    blocker.mkdir()
    (blocker / "numpy.py").write_text("raise ImportError('numpy is not installed (test)')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocker), env.get("PYTHONPATH")]))
    _run_example(tmp_path, env)


@pytest.mark.timeout(90)
def test_readme_python_example_runs(tmp_path):
    p = _run_example(tmp_path)
    assert "peer 0 self" in p.stdout and "peer 1 self" in p.stdout, p.stdout


@pytest.mark.timeout(90)
def test_readme_agent_example_runs_as_two_processes(tmp_path):
    """The agents block (prefill prints its host:port; decode connects, sends its descriptor,
    and checks the bytes after the notification), run as printed, numpy not importable."""
    if not os.path.exists(README):
        pytest.skip("README.md is not beside the tests")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", open(README).read(), re.S) if "Agent(" in b]
    assert blocks, "the README has no agent example (a Python block with Agent(...))"
    script = tmp_path / "pair.py"
    script.write_text(blocks[0])
    blocker = tmp_path / "no-numpy"
    blocker.mkdir()
    (blocker / "numpy.py").write_text("raise ImportError('numpy is not installed (test)')\n")
    env = dict(os.environ, FLAGCX_MESH_AGENT_SECRET="readme-secret")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocker), env.get("PYTHONPATH")]))
    prefill = subprocess.Popen([sys.executable, str(script), "prefill"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        address = prefill.stdout.readline().strip()
        assert re.fullmatch(r"\S+:\d+", address), (address, prefill.stderr.read() if prefill.poll() else "")
        decode = subprocess.run([sys.executable, str(script), "decode", address], capture_output=True, text=True,
                                timeout=70, env=env)
        assert decode.returncode == 0, decode.stdout + decode.stderr
        out, err = prefill.communicate(timeout=70)
        assert prefill.returncode == 0, out + err
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()
