"""flagcx_mesh.log_to_python: the core's lines reach a Python logger at their level (none on
stderr meanwhile), and log_to_stderr() gives them back to stderr. In subprocesses: the log level
is read once per process."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

PROG = r'''
import logging, sys, flagcx_mesh
got = []
class Keep(logging.Handler):
    def emit(self, record):
        got.append((record.levelname, record.getMessage()))
log = logging.getLogger("flagcx_mesh")
log.setLevel(logging.DEBUG)
log.addHandler(Keep())
flagcx_mesh.log_to_python()
flagcx_mesh.Agent("bridged", "s").close()
flagcx_mesh.log_to_stderr()
for level, text in got:
    print("PY", level, text)
sys.stdout.flush()
flagcx_mesh.Agent("unbridged", "s").close()  # back on stderr
'''


def test_lines_go_to_the_logger_then_back_to_stderr():
    p = subprocess.run([sys.executable, "-c", PROG], env=dict(os.environ, FLAGCX_MESH_LOG="info"),
                       capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stderr[-2000:]
    py = [l for l in p.stdout.splitlines() if l.startswith("PY ")]
    assert any(l.startswith("PY INFO agent bridged: incarnation ") and "listens on" in l for l in py), p.stdout
    assert not any("unbridged" in l for l in py), p.stdout
    assert "agent bridged:" not in p.stderr, p.stderr[-2000:]
    assert any(l.startswith("flagcx_mesh INFO ") and "agent unbridged: incarnation " in l
               for l in p.stderr.splitlines()), p.stderr[-2000:]


def test_a_process_that_exits_with_the_bridge_on_ends_cleanly():
    prog = ("import flagcx_mesh; flagcx_mesh.log_to_python(); "
            "flagcx_mesh.Mesh(1, flagcx_mesh.get_unique_id(), 0, timeout=10).close()")
    p = subprocess.run([sys.executable, "-c", prog], env=dict(os.environ, FLAGCX_MESH_LOG="debug"),
                       capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stderr[-2000:]
