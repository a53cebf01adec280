"""FLAGCX_MESH_LOG: a value that is no level is refused at the next mesh or agent, naming the
variable (it was silently taken as warn); every log line carries the level, a UTC timestamp
with microseconds and the pid, and in an agent program the agent's name."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

MESH = "import flagcx_mesh; flagcx_mesh.Mesh(1, flagcx_mesh.get_unique_id(), 0, timeout=10).close()"
AGENT = "import flagcx_mesh; flagcx_mesh.Agent('a', secret='s', timeout=5).close()"


def _run(prog, **env):
    return subprocess.run([sys.executable, "-c", prog], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=50)


@pytest.mark.parametrize("prog", [MESH, AGENT], ids=["mesh", "agent"])
@pytest.mark.parametrize("value", ["verbose", "trace", "3", "inf0"])
def test_a_bad_level_is_refused_naming_it(prog, value):
    p = _run(prog, FLAGCX_MESH_LOG=value)
    assert p.returncode != 0 and "InvalidArgument" in p.stderr, p.stderr[-2000:]
    assert f"FLAGCX_MESH_LOG={value} is not one of error, warn, info, debug" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("value", ["", "error", "WARN", "warning", "info", "Debug"])
def test_every_level_is_taken(value):
    p = _run(AGENT, FLAGCX_MESH_LOG=value)
    assert p.returncode == 0, p.stderr[-2000:]


LINE = re.compile(r"^flagcx_mesh (ERROR|WARN|INFO|DEBUG) "
                  r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z pid (\d+) (\[rank \d+\] )?\S")


def test_every_line_has_level_time_and_pid():
    prog = ("import os, flagcx_mesh; print(os.getpid(), flush=True); "
            "flagcx_mesh.Mesh(1, flagcx_mesh.get_unique_id(), 0, timeout=10).close()")
    p = _run(prog, FLAGCX_MESH_LOG="debug")
    assert p.returncode == 0, p.stderr[-2000:]
    pid = p.stdout.split()[0]
    lines = [l for l in p.stderr.splitlines() if l.startswith("flagcx_mesh ")]
    assert lines, "nothing logged at debug"
    for l in lines:
        m = LINE.match(l)
        assert m, l
        assert m.group(2) == pid, l


AGENT_PAIR = """
import flagcx_mesh
from flagcx_mesh import Agent
with Agent("log-a", "s", timeout=5) as a, Agent("log-b", "s", timeout=5) as b:
    m, t = a.register(bytearray(4096)), b.register(bytearray(4096))
    c = a.connect(b.metadata())
    c.write(m, t, 16, notification=b"n").wait(5)
    b.notifications(5)
    with Agent("log-c", "wrong", timeout=2) as bad:
        try:
            bad.connect(b.metadata())
        except flagcx_mesh.MeshError:
            pass
"""


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_every_line_of_an_agent_program_names_its_agent(transport):
    """An agent's lines from layers that do not know it (the interface choice at its start: the
    listener, connection and handshake lines did) name it: "agent log-a: ...", never a rank."""
    p = _run(AGENT_PAIR, FLAGCX_MESH_LOG="debug", FLAGCX_MESH_TRANSPORT=transport)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [l for l in p.stderr.splitlines() if l.startswith("flagcx_mesh ")]
    assert any("interface" in l for l in lines), "the interface choice was not logged"
    for l in lines:
        assert re.match(r"^agent log-[abc]: ", l.split(" ", 5)[5]), l
