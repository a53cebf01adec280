"""The cuMem fd server of a device window and the fetch of its fds are bounded (issue 17, item 5).

A same-user process that connects to a window's fd server and then sends part of the token, or
nothing, holds neither the window's owner nor a peer: the server reads many connections at once,
each within its own deadline, and its owner stops it at once after the registration; a peer's
fetch (connect, token, answer) is bounded by one deadline and falls back to staged, saying why.

Before the fix the server read one connection at a time and waited without bound for the rest
of a token, so one such connection kept the owner inside alloc_window(device=) for as long as
it stayed open (here: forever, the job's timeout), and with its listen backlog full a peer's
fetch blocked in connect() for as long.
"""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

import fakecuda
import gpujobs
import testdoubles
from meshutil import PY

pytestmark = pytest.mark.timeout(200)

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "fd_server_prog.py")
DROP = ("FLAGCX_MESH_CUDA_PATH", "FLAGCX_MESH_TRANSPORT", "FXM_FAKECUDA_FAIL", "FXM_FAKECUDA_NO_STREAM_MEMOPS")
JOB_TIMEOUT = 60  # the attacker never lets go before the registration completed on every rank


def run_attack(scenario: str) -> list[str]:
    env = gpujobs.job_env(fakecuda.env(granularity=64 << 10), DROP)
    cmd = [PY, "-m", "flagcx_mesh.launch", "-n", "3", "--timeout", str(JOB_TIMEOUT), "--", PY, PROG, scenario]
    try:
        p = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True, timeout=JOB_TIMEOUT + 60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{scenario}: the job hung\n{e.stdout}\n{e.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{scenario}: exit {p.returncode}\n{out[-8000:]}"
    for r in range(3):
        assert f"OK rank {r}" in p.stdout, out[-8000:]
    return [ln.split("] ", 1)[-1] for ln in out.splitlines()]


def check_registered_over_vmm(lines: list[str]) -> None:
    for r in range(2):
        line = next((ln for ln in lines if ln.startswith(f"REGISTERED rank {r}:")), None)
        assert line is not None, "\n".join(lines[-60:])
        assert f"peer {1 - r} cuda-vmm" in line, line


def test_a_connection_that_sends_part_of_the_token_holds_neither_owner_nor_peer():
    lines = run_attack("hold")
    check_registered_over_vmm(lines)
    assert "VERDICT stranger: 2 of 2 token-less connections closed by the fd servers" in lines, lines[-40:]


def test_a_full_backlog_of_silent_connections_is_drained_and_the_peer_still_gets_cuda_vmm():
    lines = run_attack("flood")
    check_registered_over_vmm(lines)
    floods = [ln.split() for ln in lines if ln.startswith("VERDICT flood:")]
    assert len(floods) == 2 and all(int(f[2]) > 64 for f in floods), floods  # more than its listen backlog


# ---------------------------------------------------------------- the fetch alone

FETCH = textwrap.dedent("""
    import ctypes, socket, sys, time
    lib = ctypes.CDLL(sys.argv[1])
    name = b"fxm-fd-test-%d-%d" % (time.time_ns(), id(lib))
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(b"\\0" + name)
    srv.listen(1)
    held = []
    if sys.argv[2] == "full":  # the listener never accepts and its backlog is full
        while True:
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(b"\\0" + name)
            except BlockingIOError:
                break
            held.append(c)
    why = ctypes.create_string_buffer(512)
    n = lib.flagcx_mesh_test_fetch_fds(name, ctypes.c_uint64(7), ctypes.c_size_t(1), 300, why, 512)
    print(f"FETCH {n} {why.value.decode()}", flush=True)
""")


@pytest.mark.parametrize("listener, reason", [
    ("full", "its fd server accepted no connection within 300 ms (its backlog stayed full)"),
    ("silent", "its fd server did not answer within 300 ms"),
])
def test_a_fetch_from_a_server_that_never_answers_returns_empty_with_a_reason(listener, reason):
    cmd = [PY, "-c", FETCH, testdoubles.testing_library(), listener]
    try:
        p = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the fetch from a {listener} listener never returned\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"FETCH -1 {reason}" in p.stdout, p.stdout + p.stderr
