"""Test programs forked from one server process that imported their heavy modules once, instead
of each program importing them itself (on a 2-core machine: torch ~3 s of CPU a process, vLLM
~17 s). Standard library only (the vLLM venv's tests use it too).

    server = ForkServer(["torch"])            # python forkserver.py --fd N torch: imports torch, waits
    p = server.popen([PY, prog, *args], env=env, stdout=PIPE, stderr=STDOUT)   # like subprocess.Popen
    out, err = p.communicate(timeout=60)      # pid, returncode, poll, wait, kill, send_signal too

Each request forks the server (one thread: nothing is held by a thread the child lacks); the
child takes the request's stdin, stdout, stderr (passed over the control socket), its own
session where asked, the working directory, the environment (whole: os.environ, and so the C
environment, is replaced; PYTHONPATH's entries are put on sys.path, PYTHONUNBUFFERED=1 unbuffers
its output), then runs ``script ARGS``, ``-m module ARGS`` or ``-c code ARGS`` as __main__ and
leaves the interpreter as a program does: exit status from SystemExit, 1 and a traceback on
stderr for an uncaught exception, atexit handlers and the C++ runtime's exit code run. The
server reports each child's exit status (negative: killed by that signal); it exits when its
client closes the control socket (the client's exit), leaving running children to their own
deadlines, as the client's own children would be left.
"""

from __future__ import annotations

import io
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
READY_TIMEOUT = 300.0  # seconds the server may take to import its modules (vLLM under load)


# ----------------------------------------------------------------------------- the server

def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(f"exit {pid} {os.waitstatus_to_exitcode(status)}".encode())


def serve(sock: socket.socket, modules: List[str]):
    """Imports `modules`, then forks one child a request; returns (request, fds) in a child,
    never in the server, which exits once the client is gone."""
    import importlib
    for name in modules:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    sock.send(f"ready {os.getpid()}".encode())
    while True:
        ready = select.select([sock], [], [], 0.05)[0]
        _reap(sock)
        if not ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not msg:
            sys.exit(0)
        pid = os.fork()
        if pid == 0:
            sock.close()
            return json.loads(msg), fds
        for fd in fds:
            os.close(fd)
        sock.send(f"pid {pid}".encode())


def _unbuffered(fd: int, old):
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors,
                            write_through=True)


def become(req: dict, fds: List[int]) -> List[str]:
    """In the child: the request's session, stdio, directory and environment; returns its argv."""
    if req["session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    if req["cwd"]:
        os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    argv = list(req["argv"][1:])
    unbuffered = os.environ.get("PYTHONUNBUFFERED") not in (None, "")
    while argv and argv[0] == "-u":
        argv.pop(0)
        unbuffered = True
    if unbuffered:
        sys.stdout, sys.stderr = _unbuffered(1, sys.stdout), _unbuffered(2, sys.stderr)
    return argv


def run_main(argv: List[str]) -> None:
    """Runs argv (without the interpreter) as the interpreter would run it as __main__."""
    import runpy
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    elif argv[0].startswith("-"):
        raise SystemExit(f"forkserver: interpreter option {argv[0]} is not supported")
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


# ----------------------------------------------------------------------------- the client

class ForkServer:
    """A server process that imported `modules`; popen() forks it (see the module's text).
    It starts at once and imports meanwhile; the first popen() waits until it is ready."""

    def __init__(self, modules: List[str], env: Optional[Dict[str, str]] = None):
        self.modules = list(modules)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--fd", str(theirs.fileno()),
                                      *self.modules], pass_fds=[theirs.fileno()], env=env,
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        theirs.close()
        self._lock = threading.Lock()  # one request at a time: a reply is a request's
        self._cond = threading.Condition()
        self._ready = False
        self._pids: List[int] = []
        self._exits: Dict[int, int] = {}
        self._gone = False
        threading.Thread(target=self._read, name="forkserver replies", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(256).decode()
            except OSError:
                msg = ""
            with self._cond:
                if not msg:
                    self._gone = True
                else:
                    kind, pid, *code = msg.split()
                    if kind == "ready":
                        self._ready = True
                    elif kind == "pid":
                        self._pids.append(int(pid))
                    else:
                        self._exits[int(pid)] = int(code[0])
                self._cond.notify_all()
            if not msg:
                return

    def _server_output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def _wait(self, cond, timeout: Optional[float], what: str) -> None:
        """Waits (self._cond held) until cond(); RuntimeError when the server is gone or, with a
        timeout, when it passes."""
        end = None if timeout is None else time.monotonic() + timeout
        while not cond():
            if self._gone:
                raise RuntimeError(f"the fork server of {self.modules} is gone ({what}):\n{self._server_output()}")
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise RuntimeError(f"the fork server of {self.modules}: no {what} in {timeout} s")
            self._cond.wait(left)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        with self._cond:
            self._wait(lambda: self._ready, timeout, "ready after importing its modules")

    def popen(self, argv: List[str], env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
              stdin=None, stdout=PIPE, stderr=PIPE, start_new_session: bool = False,
              text: bool = False) -> "Forked":
        """A child running argv (argv[0], the interpreter, is this server's); stdout PIPE, stderr
        PIPE or STDOUT, stdin None (this process's) or DEVNULL."""
        assert stdout == PIPE and stderr in (PIPE, STDOUT) and stdin in (None, DEVNULL), (stdin, stdout, stderr)
        self.wait_ready()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe() if stderr == PIPE else (None, out_w)
        in_fd = os.open(os.devnull, os.O_RDONLY) if stdin == DEVNULL else 0
        req = {"argv": [str(a) for a in argv], "env": dict(os.environ if env is None else env),
               "cwd": cwd and str(cwd), "session": start_new_session}
        try:
            with self._lock:
                socket.send_fds(self.sock, [json.dumps(req).encode()], [in_fd, out_w, err_w])
                with self._cond:
                    self._wait(lambda: self._pids, 30, "answer to a fork request")
                    pid = self._pids.pop(0)
        finally:
            for fd in {out_w, err_w, in_fd} - {0}:
                os.close(fd)
        return Forked(self, pid, argv, out_r, err_r, text)

    def exit_code(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """pid's exit status once the server reported it; None while it runs past `timeout`."""
        with self._cond:
            try:
                self._wait(lambda: pid in self._exits, timeout, f"exit of {pid}")
            except RuntimeError:
                if self._gone:
                    raise
                return None
            return self._exits[pid]

    def close(self) -> None:
        """Ends the server (running children run on)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # close() alone leaves the reader's recv() holding it
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Forked:
    """A child of a ForkServer, with the part of subprocess.Popen's interface the tests use."""

    def __init__(self, server: ForkServer, pid: int, argv, out_fd: int, err_fd: Optional[int], text: bool):
        self.server, self.pid, self.args, self.text = server, pid, list(argv), text
        self.returncode: Optional[int] = None
        self._chunks = {"out": [], "err": []}
        self._readers = [self._reader("out", out_fd)] + ([self._reader("err", err_fd)] if err_fd is not None else [])
        self._merged = err_fd is None

    def _reader(self, name: str, fd: int) -> threading.Thread:
        def read():
            with open(fd, "rb", closefd=True) as f:
                for chunk in iter(lambda: f.read1(1 << 16), b""):
                    self._chunks[name].append(chunk)
        t = threading.Thread(target=read, name=f"forked {self.pid} std{name}", daemon=True)
        t.start()
        return t

    def poll(self) -> Optional[int]:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """The exit status; raises subprocess.TimeoutExpired past `timeout` (poll(): None)."""
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout)
            if self.returncode is None and timeout != 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _text(self, name: str):
        data = b"".join(self._chunks[name])
        return data.decode(errors="replace") if self.text else data

    def communicate(self, timeout: Optional[float] = None):
        """(stdout, stderr) once the child exited and its output ended (stderr None if merged)."""
        end = None if timeout is None else time.monotonic() + timeout
        try:
            self.wait(timeout)
            for t in self._readers:
                t.join(None if end is None else max(0.0, end - time.monotonic()))
            if any(t.is_alive() for t in self._readers):
                raise subprocess.TimeoutExpired(self.args, timeout)
        except subprocess.TimeoutExpired as e:
            e.output, e.stderr = self._text("out"), None if self._merged else self._text("err")
            raise
        return self._text("out"), None if self._merged else self._text("err")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        import signal
        self.send_signal(signal.SIGTERM)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "--fd":
        raise SystemExit("usage: python forkserver.py --fd FD MODULE...  (ForkServer starts it)")
    _request, _fds = serve(socket.socket(fileno=int(sys.argv[2])), sys.argv[3:])
    run_main(become(_request, _fds))
