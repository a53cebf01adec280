"""Shared by the bootstrap tests: bounded subprocesses, free ports, an unrelated listener."""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "bootstrap_job.py")
PY = sys.executable
# Variables of an outer launcher that would confuse the jobs these tests start.
LAUNCH_VARS = ("FLAGCX_MESH_LAUNCHER", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
               "TORCHELASTIC_RESTART_COUNT", "PMI_RANK", "PMI_SIZE", "PMI_FD",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_NAMESPACE")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Result(str):
    """A finished command: rc, out, err, timed_out. It is the text an assertion message shows (the
    outputs' last 4000 characters each): a str, which pytest prints whole (any other message object
    it cuts to 240 characters, which left a failure's cause out)."""

    def __new__(cls, rc, out, err, timed_out):
        state = "TIMED OUT" if timed_out else f"rc={rc}"
        self = super().__new__(cls, f"{state}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}")
        self.rc, self.out, self.err, self.timed_out = rc, out, err, timed_out
        return self


def run(cmd, timeout, env=None, server=None):
    """Runs cmd in its own session; on timeout kills the whole group. Never hangs. With a
    server (forkserver.ForkServer), cmd is forked from it, which imported torch already."""
    p = start(cmd, env if env is not None else clean_env(), server)
    try:
        out, err = p.communicate(timeout=timeout)
        return Result(p.returncode, out.decode(errors="replace"), err.decode(errors="replace"), False)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate(timeout=10)
        return Result(p.returncode, out.decode(errors="replace"), err.decode(errors="replace"), True)


def start(cmd, env, server=None):
    """cmd in its own session, its output piped (forked from `server` where one is given)."""
    popen = subprocess.Popen if server is None else server.popen
    return popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, start_new_session=True, cwd=HERE)


def finish(procs, timeout):
    """Waits for every Popen (bounded, killing stragglers); returns their Results."""
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
            results.append(Result(p.returncode, out.decode(errors="replace"),
                                  err.decode(errors="replace"), False))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate(timeout=10)
            results.append(Result(p.returncode, out.decode(errors="replace"),
                                  err.decode(errors="replace"), True))
    return results


def ok_lines(text, mode):
    """The "OK <mode> rank R of N" reports in text (MPI launchers may interleave the lines)."""
    return sorted(set(re.findall(rf"OK {re.escape(mode)} rank \d+ of \d+", text)))


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextmanager
def unrelated_listener(port=0, behaviour="silent", taken_is_fine=False):
    """A listener that is not a store: 'silent' accepts and never answers; 'close' hangs up.

    Yields its port. Binds like an unrelated server would (SO_REUSEADDR, all interfaces).
    With taken_is_fine, a port some other process already holds is yielded as is.
    """
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
    except OSError as e:
        s.close()
        if taken_is_fine and port:
            yield port
            return
        pytest.fail(f"cannot bind port {port} for the unrelated listener: {e}")
    s.listen(64)
    s.settimeout(0.2)
    stop, held = threading.Event(), []

    def serve():
        while not stop.is_set():
            try:
                c, _ = s.accept()
            except OSError:
                continue
            if behaviour == "close":
                c.close()
            else:
                held.append(c)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield s.getsockname()[1]
    finally:
        stop.set()
        t.join(2)
        for c in held:
            c.close()
        s.close()
