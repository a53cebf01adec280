"""tests/forkserver.py: a child forked from the server runs a program as a fresh interpreter
would (argv, sys.path, environment, directory, session, stdio, exit status, atexit) and
finds the server's imports already made."""

import os
import signal
import subprocess
import sys
import time

import pytest

from forkserver import DEVNULL, PIPE, STDOUT, ForkServer

pytestmark = pytest.mark.timeout(60)
PY = sys.executable
PROBE = "import os\nIMPORTED_IN = os.getpid()\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("forkserver")
    (d / "fs_probe.py").write_text(PROBE)
    (d / "fs_main.py").write_text("import sys\nprint('main', __name__, sys.argv[1:], sys.path[0])\n")
    env = dict(os.environ, PYTHONPATH=str(d), FXM_FS_SERVER_ONLY="1")
    s = ForkServer(["fs_probe"], env=env)
    s.dir = d
    yield s
    s.close()


def run(server, argv, timeout=30, **kw):
    kw.setdefault("env", {k: v for k, v in os.environ.items() if k != "FXM_FS_SERVER_ONLY"})
    p = server.popen([PY, *argv], text=True, **kw)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def test_a_child_finds_the_servers_import_made_and_is_its_own_process(server):
    code = "import os, fs_probe\nprint(fs_probe.IMPORTED_IN, os.getpid(), os.getppid())"
    rc, out, err = run(server, ["-c", code])
    assert rc == 0, err
    imported_in, pid, parent = map(int, out.split())
    assert imported_in == server.proc.pid == parent and pid != imported_in, out


@pytest.mark.parametrize("code, rc, says", [
    ("print('fine')", 0, ""),
    ("import sys; sys.exit(3)", 3, ""),
    ("import os; os._exit(9)", 9, ""),
    ("raise SystemExit('a reason')", 1, "a reason"),
    ("raise ValueError('what broke')", 1, "ValueError: what broke"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM, ""),
])
def test_exit_status_as_a_program(server, code, rc, says):
    got, out, err = run(server, ["-c", code])
    assert got == rc and says in err, (got, out, err)
    assert ("Traceback" in err) == (rc == 1 and "Error" in says), err


def test_argv_path_environment_directory_session_and_stdin(server, tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import ctypes, os, sys\n"
                      "getenv = ctypes.CDLL(None).getenv\n"
                      "getenv.restype = ctypes.c_char_p\n"
                      "print(sys.argv, sys.path[0], os.getcwd())\n"
                      "print(os.environ.get('FXM_FS_SERVER_ONLY'), getenv(b'FXM_FS_SERVER_ONLY'))\n"
                      "print(os.environ['FXM_FS_CHILD'], os.getsid(0) == os.getpid(), repr(sys.stdin.read()))\n")
    env = {k: v for k, v in os.environ.items() if k != "FXM_FS_SERVER_ONLY"}
    env["FXM_FS_CHILD"] = "yes"
    rc, out, err = run(server, [script, "a", "b"], env=env, cwd=server.dir, stdin=DEVNULL, start_new_session=True)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == f"{[str(script), 'a', 'b']} {tmp_path} {server.dir}", out
    assert lines[1] == "None None", out  # gone from os.environ and from the C environment
    assert lines[2] == "yes True ''", out
    rc, out, _ = run(server, [script], env=env, stdin=DEVNULL)  # not asked: the server's session
    assert out.splitlines()[2] == "yes False ''", out


def test_module_mode_and_atexit(server):
    rc, out, err = run(server, ["-m", "fs_main", "x"], cwd=server.dir)
    assert rc == 0 and out == f"main __main__ ['x'] {server.dir}\n", (out, err)
    rc, out, err = run(server, ["-c", "import atexit; atexit.register(print, 'at exit'); print('body')"])
    assert rc == 0 and out == "body\nat exit\n", (out, err)


def test_stderr_merged_in_order_and_apart(server):
    code = ("import sys\nfor i in range(3):\n"
            "    print('out', i, flush=True); print('err', i, file=sys.stderr, flush=True)")
    rc, out, err = run(server, ["-c", code], stderr=STDOUT)
    assert rc == 0 and err is None and out.split() == "out 0 err 0 out 1 err 1 out 2 err 2".split(), out
    rc, out, err = run(server, ["-c", code], stderr=PIPE)
    assert out.split() == "out 0 out 1 out 2".split() and err.split() == "err 0 err 1 err 2".split()


def test_a_child_past_its_timeout_is_killed_and_the_server_serves_on(server):
    p = server.popen([PY, "-c", "import time; print('started', flush=True); time.sleep(60)"], text=True)
    with pytest.raises(subprocess.TimeoutExpired):
        p.communicate(timeout=1)
    assert p.poll() is None
    p.kill()
    out, _ = p.communicate(timeout=10)
    assert p.returncode == -signal.SIGKILL and out == "started\n", (p.returncode, out)
    assert run(server, ["-c", "print('next')"])[:2] == (0, "next\n")


def test_a_server_that_cannot_import_says_why():
    s = ForkServer(["fs_no_such_module_here"])
    try:
        with pytest.raises(RuntimeError, match="is gone(.|\n)*No module named 'fs_no_such_module_here'"):
            s.popen([PY, "-c", "pass"])
    finally:
        s.close()
    assert s.proc.returncode == 1


def test_closing_the_client_side_ends_the_server():
    """close() while the reply reader waits in recv(): the server sees the end (it exits 0;
    close() kills it, -9, when it does not within 30 s)."""
    s = ForkServer(["json"])
    s.wait_ready(60)
    time.sleep(0.3)  # (sequencing: the reader is back in recv())
    s.close()
    assert s.proc.returncode == 0
