"""examples/vllm/run_pd.sh fails fast, with the server's log tail, when a server dies at start or
is not up within STARTUP_TIMEOUT (it waited on /health forever). A stand-in `vllm` on PATH plays
the server: no vLLM or GPU needed."""

import os
import socket
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "vllm", "run_pd.sh")
pytestmark = pytest.mark.timeout(90)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, body, timeout_s="600"):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "vllm"
    fake.write_text("#!/usr/bin/env bash\n" + body)
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", LOG_DIR=str(tmp_path / "logs"),
               STARTUP_TIMEOUT=timeout_s, PREFILL_PORT=str(_free_port()), DECODE_PORT=str(_free_port()),
               FLAGCX_MESH_AGENT_SECRET="x")
    t0 = time.monotonic()
    p = subprocess.run(["bash", SCRIPT, "tiny-model"], env=env, capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    return p, time.monotonic() - t0


def test_a_server_that_dies_at_start_stops_the_script_with_its_log(tmp_path):
    body = ('case "$*" in *kv_consumer*) echo "ValueError: no such connector option" >&2; exit 1;; esac\n'
            "sleep 50\n")
    p, took = _run(tmp_path, body)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "the decode server exited before it was up" in p.stderr, p.stderr
    assert "ValueError: no such connector option" in p.stderr, p.stderr
    assert took < 30, took
    assert (tmp_path / "logs" / "decode.log").exists()


def test_a_server_never_up_stops_the_script_at_the_startup_timeout(tmp_path):
    p, took = _run(tmp_path, "echo loading forever\nsleep 50\n", timeout_s="3")
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "the prefill server was not up" in p.stderr and "within 3 s" in p.stderr, p.stderr
    assert "loading forever" in p.stderr, p.stderr
    assert took < 30, took
