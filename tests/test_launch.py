"""Tests of the embedded launcher (flagcx_mesh.launch); no C++ extension call is needed
because every launch() gets an explicit unique_id."""
import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from flagcx_mesh import launch

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")]

UID = bytes(range(256))
PY = sys.executable
# Child processes load launch.py by path (it needs only the standard library), so they do not
# depend on how the package and its extension are installed.
LOAD_LAUNCH = f"""
import importlib.util, sys
_spec = importlib.util.spec_from_file_location("_fm_launch", {os.path.abspath(launch.__file__)!r})
L = importlib.util.module_from_spec(_spec)
sys.modules["_fm_launch"] = L
_spec.loader.exec_module(L)
"""


def run(code, nranks, **kw):
    """launch() `python -c code` on nranks ranks; returns (rc, stdout text, stderr text, secs)."""
    out, err = io.StringIO(), io.StringIO()
    kw.setdefault("unique_id", UID)
    t0 = time.monotonic()
    rc = launch.launch([PY, "-c", textwrap.dedent(code)], nranks, stdout=out, stderr=err, **kw)
    return rc, out.getvalue(), err.getvalue(), time.monotonic() - t0


def pid_dead(pid, within=5.0):
    """True once pid is gone or a zombie (reparented zombies may linger in containers)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        except OSError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.05)
    return False


# ----------------------------------------------------------------------------- success

def test_all_ranks_succeed_and_see_their_environment():
    rc, out, err, _ = run("""
        import os, sys
        e = os.environ
        print(e["FLAGCX_MESH_RANK"], e["FLAGCX_MESH_NRANKS"], e["FLAGCX_MESH_LOCAL_RANK"],
              e["FLAGCX_MESH_LOCAL_SIZE"], e["FLAGCX_MESH_LAUNCHER"], e["FLAGCX_MESH_UNIQUE_ID"])
        print("note from", e["FLAGCX_MESH_RANK"], file=sys.stderr)
    """, 3)
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 3
    for k in range(3):
        assert f"[rank {k}] {k} 3 {k} 3 1 {UID.hex()}" in lines
        assert f"[rank {k}] note from {k}" in err.splitlines()
    assert "flagcx_mesh.launch:" not in err
    assert UID.hex() == UID.hex().lower() and len(UID.hex()) == 512


def test_env_override_and_no_prefix_and_ranks_from_env_round_trip():
    rc, out, err, _ = run(LOAD_LAUNCH + textwrap.dedent("""
        import os
        rank, n, uid = L.ranks_from_env()
        print(os.environ["EXTRA_VAR"], rank, n, uid == bytes(range(256)))
    """), 2, prefix=False, env={"EXTRA_VAR": "hello"})
    assert rc == 0, err
    assert sorted(out.splitlines()) == ["hello 0 2 True", "hello 1 2 True"]


def test_partial_last_line_is_forwarded():
    rc, out, _, _ = run("import sys; sys.stdout.write('no newline')", 1)
    assert rc == 0 and out == "[rank 0] no newline\n"


# ----------------------------------------------------------------------------- failures

def test_failing_rank_stops_the_others_quickly():
    rc, _, err, secs = run("""
        import os, sys, time
        if os.environ["FLAGCX_MESH_RANK"] == "1":
            print("something broke", file=sys.stderr)
            sys.exit(3)
        time.sleep(60)
    """, 3, grace=2.0)
    assert rc == 3
    assert secs < 20
    assert "flagcx_mesh.launch: rank 1 failed: exit code 3" in err
    assert "    something broke" in err.splitlines()
    assert "ranks stopped by the launcher: [0, 2]; ranks that failed on their own: [1]" in err
    assert "rank 0 stopped by the launcher (killed by signal SIGTERM)" in err


def test_rank_killed_by_sigkill():
    rc, _, err, secs = run("""
        import os, signal, time
        if os.environ["FLAGCX_MESH_RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """, 2, grace=1.0)
    assert rc == 128 + signal.SIGKILL
    assert secs < 20
    assert "rank 0 failed: killed by signal SIGKILL" in err
    assert "ranks stopped by the launcher: [1]" in err


def test_rank_ignoring_sigterm_is_killed_after_grace(tmp_path):
    marker = tmp_path / "ready"
    rc, _, err, secs = run(f"""
        import os, signal, sys, time
        if os.environ["FLAGCX_MESH_RANK"] == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            open({str(marker)!r}, "w").close()
            time.sleep(60)
        while not os.path.exists({str(marker)!r}):
            time.sleep(0.01)
        sys.exit(1)
    """, 2, grace=0.5)
    assert rc == 1
    assert 0.5 <= secs < 20
    assert "rank 1 failed: exit code 1" in err
    assert "rank 0 stopped by the launcher (killed by signal SIGKILL)" in err


def test_grandchildren_are_killed_with_their_rank(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    rc, _, err, _ = run(f"""
        import os, subprocess, sys, time
        if os.environ["FLAGCX_MESH_RANK"] == "0":
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            with open({str(pidfile) + ".tmp"!r}, "w") as f:
                f.write(str(p.pid))
            os.rename({str(pidfile) + ".tmp"!r}, {str(pidfile)!r})
            time.sleep(60)
        while not os.path.exists({str(pidfile)!r}):
            time.sleep(0.01)
        sys.exit(2)
    """, 2, grace=1.0)
    assert rc == 2, err
    assert pid_dead(int(pidfile.read_text()))


def test_timeout_returns_124():
    rc, _, err, secs = run("import time; time.sleep(60)", 2, timeout=0.5, grace=1.0)
    assert rc == 124
    assert secs < 20
    assert "flagcx_mesh.launch: timed out after 0.5 s; ranks still running: [0, 1]" in err
    assert "ranks stopped by the launcher: [0, 1]; ranks that failed on their own: []" in err


def test_command_that_cannot_start_returns_127():
    out, err = io.StringIO(), io.StringIO()
    rc = launch.launch(["/nonexistent/flagcx-mesh-cmd"], 2, unique_id=UID, stdout=out, stderr=err)
    assert rc == 127
    assert "cannot start rank 0" in err.getvalue()


def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="256 bytes"):
        launch.launch([PY, "-c", "pass"], 1, unique_id=b"short")
    with pytest.raises(ValueError, match="nranks"):
        launch.launch([PY, "-c", "pass"], 0, unique_id=UID)
    with pytest.raises(ValueError, match="empty command"):
        launch.launch([], 1, unique_id=UID)


# ----------------------------------------------------------------------------- signals to the launcher

@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_launcher_is_forwarded_and_stops_ranks(sig, code):
    rank = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    driver = (LOAD_LAUNCH + "\nimport sys\n"
              f"sys.exit(L.launch([sys.executable, '-c', {rank!r}], 2, "
              "unique_id=bytes(range(256)), grace=1.0, prefix=False))")
    proc = subprocess.Popen([PY, "-c", driver], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pids = [int(proc.stdout.readline()) for _ in range(2)]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert f"got {signal.Signals(sig).name}" in err
    assert "ranks stopped by the launcher: [0, 1]" in err
    assert all(pid_dead(p) for p in pids)


# ----------------------------------------------------------------------------- ranks_from_env

def _env(**over):
    env = {"FLAGCX_MESH_LAUNCHER": "1", "FLAGCX_MESH_RANK": "2", "FLAGCX_MESH_NRANKS": "4",
           "FLAGCX_MESH_UNIQUE_ID": UID.hex()}
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


def test_ranks_from_env_valid():
    assert launch.ranks_from_env(_env()) == (2, 4, UID)


def test_ranks_from_env_reads_os_environ(monkeypatch):
    for k, v in _env(FLAGCX_MESH_RANK="0", FLAGCX_MESH_NRANKS="1").items():
        monkeypatch.setenv(k, v)
    assert launch.ranks_from_env() == (0, 1, UID)
    monkeypatch.delenv("FLAGCX_MESH_LAUNCHER")
    assert launch.ranks_from_env() is None


@pytest.mark.parametrize("over", [
    {"FLAGCX_MESH_LAUNCHER": None}, {"FLAGCX_MESH_LAUNCHER": "0"},
    {"FLAGCX_MESH_RANK": None}, {"FLAGCX_MESH_UNIQUE_ID": None},
])
def test_ranks_from_env_absent_is_none(over):
    assert launch.ranks_from_env(_env(**over)) is None


@pytest.mark.parametrize("over, match", [
    ({"FLAGCX_MESH_UNIQUE_ID": "zz" * 256}, "FLAGCX_MESH_UNIQUE_ID: not valid hex"),
    ({"FLAGCX_MESH_UNIQUE_ID": UID.hex()[:-2]}, "255 bytes, expected 256"),
    ({"FLAGCX_MESH_UNIQUE_ID": UID.hex() + "00"}, "257 bytes"),
    ({"FLAGCX_MESH_RANK": "two"}, "FLAGCX_MESH_RANK='two': not a decimal integer"),
    ({"FLAGCX_MESH_RANK": "4"}, r"must be in \[0, 4\)"),
    ({"FLAGCX_MESH_RANK": "-1"}, r"must be in \[0, 4\)"),
    ({"FLAGCX_MESH_NRANKS": "0"}, "FLAGCX_MESH_NRANKS='0': must be >= 1"),
])
def test_ranks_from_env_malformed_raises(over, match):
    with pytest.raises(ValueError, match=match):
        launch.ranks_from_env(_env(**over))


# ----------------------------------------------------------------------------- main()

@pytest.mark.parametrize("argv", [
    ["-n", "2"],                    # no command
    ["-n", "2", "--"],              # empty command
    ["-n", "0", "--", PY, "-c", "pass"],
    ["-n", "x", "--", PY, "-c", "pass"],
    ["--", PY, "-c", "pass"],       # -n missing
    ["-n", "1", "--timeout", "0", "--", PY, "-c", "pass"],
    ["-n", "1", "--grace", "-1", "--", PY, "-c", "pass"],
])
def test_main_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        launch.main(argv)
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_main_help_exits_0(capsys):
    with pytest.raises(SystemExit) as info:
        launch.main(["-h"])
    assert info.value.code == 0
    assert "--timeout" in capsys.readouterr().out


def test_main_runs_the_command(monkeypatch, capsys):
    monkeypatch.setattr(launch, "_get_unique_id", lambda: UID)
    rc = launch.main(["-n", "2", "--no-prefix", "--", PY, "-c",
                      "import os; print(os.environ['FLAGCX_MESH_RANK'])"])
    assert rc == 0
    assert sorted(capsys.readouterr().out.split()) == ["0", "1"]


def test_main_without_double_dash_runs_a_py_script_under_this_python(monkeypatch, capsys, tmp_path):
    """`launch -n 2 job.py ARGS`: CMD begins at the first non-option word; a .py file runs under
    the launcher's interpreter (it need not be executable), its own options pass through."""
    monkeypatch.setattr(launch, "_get_unique_id", lambda: UID)
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nprint(os.environ['FLAGCX_MESH_RANK'], sys.executable == "
                      f"{PY!r}, *sys.argv[1:])\n")
    rc = launch.main(["-n", "2", "--grace", "1", "--no-prefix", str(script), "--layers", "3"])
    assert rc == 0
    lines = sorted(capsys.readouterr().out.splitlines())
    assert lines == ["0 True --layers 3", "1 True --layers 3"], lines


@pytest.mark.parametrize("argv", [["-n2", "--no-prefix"], ["--nranks=2", "--no-prefix"],
                                  ["-n", "2", "--no-prefix", "--"]])
def test_main_finds_the_command_after_attached_values_and_keeps_its_double_dash(monkeypatch, capsys, argv):
    """`-n2` and `--nranks=2` are one word each; a `--` that comes after the command start
    belongs to the command (regression: `-n2 prog` was an argparse error, and the first `--`
    anywhere was taken as the separator)."""
    monkeypatch.setattr(launch, "_get_unique_id", lambda: UID)
    rc = launch.main(argv + [PY, "-c", "import os, sys; print(os.environ['FLAGCX_MESH_RANK'], *sys.argv[1:])",
                             "--", "x"])
    assert rc == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["0 -- x", "1 -- x"]
