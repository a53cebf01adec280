"""Embedded launcher: start N local rank processes that share one flagcx_mesh unique id.

Usage::

    python -m flagcx_mesh.launch -n N [--timeout S] [--grace G] [--no-prefix] [--] CMD [ARGS...]

CMD starts at ``--`` or, without it, at the first word that is not a launcher option.
A CMD that is a ``.py`` file runs under the launcher's Python interpreter.

The launcher makes one unique id with ``flagcx_mesh.get_unique_id()`` (this starts the
rendezvous server inside the launcher process, which stays alive while the ranks run),
then starts N copies of CMD, each in its own process group, with these variables set:

    FLAGCX_MESH_RANK         this process's rank, 0..N-1
    FLAGCX_MESH_NRANKS       N
    FLAGCX_MESH_LOCAL_RANK   same as FLAGCX_MESH_RANK (all ranks are local)
    FLAGCX_MESH_LOCAL_SIZE   N
    FLAGCX_MESH_UNIQUE_ID    the 256-byte unique id as lowercase hex (512 characters)
    FLAGCX_MESH_LAUNCHER     1
    PYTHONUNBUFFERED         1, unless already set (so Python ranks' lines arrive promptly)

A rank reads them with :func:`ranks_from_env`. Stdin of every rank is /dev/null.
Each rank's stdout/stderr is forwarded line by line to the launcher's stdout/stderr,
prefixed ``[rank K] `` (``--no-prefix`` turns the prefix off).

Exit status:
    0          all ranks exited 0
    K          the failing rank exited with code K (128+signum if killed by a signal; when
               several failed at once, one killed by a signal is reported first);
               the launcher prints which rank failed and its last stderr lines, then stops the
               others (SIGTERM to each process group, SIGKILL after --grace seconds, default 3)
    124        --timeout S expired (wall clock for the whole job); all ranks are stopped
    127        CMD could not be started
    130 / 143  the launcher got SIGINT / SIGTERM: it forwards the signal to the ranks,
               then stops them as above
    2          usage error
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

UNIQUE_ID_BYTES = 256
ENV_RANK = "FLAGCX_MESH_RANK"
ENV_NRANKS = "FLAGCX_MESH_NRANKS"
ENV_LOCAL_RANK = "FLAGCX_MESH_LOCAL_RANK"
ENV_LOCAL_SIZE = "FLAGCX_MESH_LOCAL_SIZE"
ENV_UNIQUE_ID = "FLAGCX_MESH_UNIQUE_ID"
ENV_LAUNCHER = "FLAGCX_MESH_LAUNCHER"

EXIT_TIMEOUT = 124
EXIT_CANNOT_START = 127
TAIL_LINES = 20
_POLL_S = 0.02
_KILL_WAIT_S = 5.0     # bound on waiting for a SIGKILLed process group to be reaped
_READER_JOIN_S = 2.0   # bound on waiting for the reader threads to drain the pipes
_MSG = "flagcx_mesh.launch: "


@dataclass
class _Rank:
    """One rank process, its reader threads and the tail of its stderr."""

    rank: int
    proc: subprocess.Popen
    tail: Deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    readers: List[threading.Thread] = field(default_factory=list)
    stopped: bool = False  # True once the launcher has signalled it while it was running


class _Output:
    """Serialises writes of whole lines to the launcher's stdout/stderr (any write/flush object)."""

    def __init__(self, out: Any, err: Any) -> None:
        self.out, self.err = out, err
        self._lock = threading.Lock()

    def line(self, stream: Any, text: str) -> None:
        with self._lock:
            stream.write(text if text.endswith("\n") else text + "\n")
            flush = getattr(stream, "flush", None)
            if flush is not None:
                flush()

    def msg(self, text: str) -> None:
        self.line(self.err, _MSG + text)


# ----------------------------------------------------------------------------- rank side

def ranks_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[int, int, bytes]]:
    """Return (rank, nranks, unique_id) when started by this launcher, else None.

    None when FLAGCX_MESH_LAUNCHER is not "1" or one of the variables is missing.
    Raises ValueError, naming the variable, when a value is malformed.
    """
    env = os.environ if environ is None else environ
    if env.get(ENV_LAUNCHER) != "1":
        return None
    raw = [env.get(name) for name in (ENV_RANK, ENV_NRANKS, ENV_UNIQUE_ID)]
    if any(v is None for v in raw):
        return None
    rank, nranks = _parse_int(ENV_RANK, raw[0]), _parse_int(ENV_NRANKS, raw[1])
    if nranks < 1:
        raise ValueError(f"{ENV_NRANKS}={raw[1]!r}: must be >= 1")
    if not 0 <= rank < nranks:
        raise ValueError(f"{ENV_RANK}={raw[0]!r}: must be in [0, {nranks})")
    return rank, nranks, _parse_unique_id(raw[2])


def _parse_int(name: str, value: str) -> int:
    try:
        return int(value.strip(), 10)
    except ValueError:
        raise ValueError(f"{name}={value!r}: not a decimal integer") from None


def _parse_unique_id(value: str) -> bytes:
    try:
        uid = bytes.fromhex(value.strip())
    except ValueError:
        raise ValueError(f"{ENV_UNIQUE_ID}: not valid hex ({len(value)} characters)") from None
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"{ENV_UNIQUE_ID}: decodes to {len(uid)} bytes, "
                         f"expected {UNIQUE_ID_BYTES} ({2 * UNIQUE_ID_BYTES} hex characters)")
    return uid


# ----------------------------------------------------------------------------- launcher side

def _rank_env(base: Mapping[str, str], extra: Optional[Mapping[str, str]],
              rank: int, nranks: int, uid_hex: str) -> Dict[str, str]:
    env = dict(base)
    env.update(extra or {})
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update({ENV_RANK: str(rank), ENV_NRANKS: str(nranks), ENV_LOCAL_RANK: str(rank),
                ENV_LOCAL_SIZE: str(nranks), ENV_UNIQUE_ID: uid_hex, ENV_LAUNCHER: "1"})
    return env


def _forward(pipe: IO[bytes], out: _Output, stream: Any, prefix: str,
             tail: Optional[Deque[str]]) -> None:
    """Reader thread body: copy lines from a rank's pipe to the launcher's stream."""
    writable = True
    try:
        for raw in iter(pipe.readline, b""):
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if tail is not None:
                tail.append(text)
            if writable:
                try:
                    out.line(stream, prefix + text)
                except (OSError, ValueError):
                    writable = False  # our stream is gone: keep draining so the rank never blocks
    except (OSError, ValueError):
        pass  # pipe closed under us; nothing more to forward
    finally:
        pipe.close()


def _start_rank(cmd: Sequence[str], rank: int, env: Dict[str, str],
                out: _Output, prefix: bool) -> _Rank:
    proc = subprocess.Popen(list(cmd), env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    r = _Rank(rank, proc)
    tag = f"[rank {rank}] " if prefix else ""
    for pipe, stream, tail in ((proc.stdout, out.out, None), (proc.stderr, out.err, r.tail)):
        t = threading.Thread(target=_forward, args=(pipe, out, stream, tag, tail),
                             name=f"flagcx_mesh.launch rank {rank}", daemon=True)
        t.start()
        r.readers.append(t)
    return r


def _signal_group(r: _Rank, sig: int) -> None:
    """Signal the rank's whole process group (grandchildren too); ignore vanished groups."""
    try:
        os.killpg(r.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_all(ranks: Sequence[_Rank], seconds: float) -> bool:
    """Wait up to `seconds` for every rank to exit; True if all did."""
    deadline = time.monotonic() + seconds
    while any(r.proc.poll() is None for r in ranks):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _stop_all(ranks: Sequence[_Rank], grace: float, first: Optional[int] = None) -> None:
    """Stop every rank: [first signal, wait grace,] SIGTERM, wait grace, SIGKILL.

    Always terminates: the SIGKILL wait is bounded. Groups of ranks that already exited are
    SIGKILLed as well, so no grandchild outlives the job.
    """
    sequence = [first] if first not in (None, signal.SIGTERM) else []
    for sig in sequence + [signal.SIGTERM]:
        for r in ranks:
            if r.proc.poll() is None:
                r.stopped = True
                _signal_group(r, sig)
        if _wait_all(ranks, grace):
            break
    for r in ranks:
        _signal_group(r, signal.SIGKILL)
    _wait_all(ranks, _KILL_WAIT_S)


def _describe(returncode: Optional[int]) -> str:
    if returncode is None:
        return "still running"
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return f"killed by signal {name}"


def _exit_code(returncode: int) -> int:
    code = 128 - returncode if returncode < 0 else returncode
    return code if code != 0 else 1


def _join_readers(ranks: Sequence[_Rank], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for r in ranks:
        for t in r.readers:
            t.join(max(0.0, deadline - time.monotonic()))


def _report_failure(r: _Rank, out: _Output, also: bool = False) -> None:
    _join_readers([r], 1.0)  # let its stderr drain so the tail is complete
    out.msg(f"rank {r.rank} {'also ' if also else ''}failed: {_describe(r.proc.returncode)}")
    if r.tail:
        out.msg(f"last {len(r.tail)} stderr line(s) of rank {r.rank}:")
        for text in list(r.tail):
            out.line(out.err, "    " + text)


def _report_stopped(ranks: Sequence[_Rank], first: Optional[_Rank], out: _Output) -> None:
    """After a stop: say which ranks the launcher stopped and which failed on their own."""
    own = [r for r in ranks if not r.stopped and r.proc.returncode not in (0, None)]
    for r in own:
        if r is not first:
            _report_failure(r, out, also=True)
    for r in ranks:
        if r.stopped:
            out.msg(f"rank {r.rank} stopped by the launcher ({_describe(r.proc.returncode)})")
    out.msg(f"ranks stopped by the launcher: {[r.rank for r in ranks if r.stopped]}; "
            f"ranks that failed on their own: {[r.rank for r in own]}")


class _SignalBox:
    """Records SIGINT/SIGTERM sent to the launcher (handlers only in the main thread)."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._saved: Dict[int, Any] = {}

    def __enter__(self) -> "_SignalBox":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


def _supervise(ranks: Sequence[_Rank], deadline: Optional[float],
               box: _SignalBox) -> Tuple[str, Optional[_Rank]]:
    """Poll until an event: ("done"|"failed"|"timeout"|"signal", failing rank or None)."""
    while True:
        if box.received is not None:
            return "signal", None
        codes = [(r, r.proc.poll()) for r in ranks]
        failed = [(r, rc) for r, rc in codes if rc not in (0, None)]
        if failed:
            # Several failures seen in one sweep (the others fail fast once one
            # dies): a rank killed by a signal is the likelier origin.
            failed.sort(key=lambda f: (f[1] >= 0, f[0].rank))
            return "failed", failed[0][0]
        if all(rc == 0 for _, rc in codes):
            return "done", None
        if deadline is not None and time.monotonic() >= deadline:
            return "timeout", None
        time.sleep(_POLL_S)


def _get_unique_id() -> bytes:
    # lazy: the C++ extension may not be built yet; the core's call, as mesh.py imports this module
    from ._core import get_unique_id
    return bytes(get_unique_id(0))


def _start_all(cmd: Sequence[str], nranks: int, uid: bytes, extra: Optional[Mapping[str, str]],
               out: _Output, prefix: bool) -> Tuple[List[_Rank], Optional[OSError]]:
    ranks: List[_Rank] = []
    base, uid_hex = dict(os.environ), uid.hex()
    for k in range(nranks):
        try:
            ranks.append(_start_rank(cmd, k, _rank_env(base, extra, k, nranks, uid_hex),
                                     out, prefix))
        except OSError as e:
            return ranks, e
    return ranks, None


def _finish(event: str, culprit: Optional[_Rank], ranks: List[_Rank], out: _Output,
            grace: float, timeout: Optional[float], signum: Optional[int]) -> int:
    """Act on the supervision result; returns the launcher's exit code."""
    if event == "done":
        _join_readers(ranks, _READER_JOIN_S)
        return 0
    if event == "failed":
        assert culprit is not None
        _report_failure(culprit, out)
        code = _exit_code(culprit.proc.returncode)
    elif event == "timeout":
        running = [r.rank for r in ranks if r.proc.poll() is None]
        out.msg(f"timed out after {timeout:g} s; ranks still running: {running}")
        code = EXIT_TIMEOUT
    else:
        assert signum is not None
        out.msg(f"got {signal.Signals(signum).name}; forwarding it to the ranks and stopping them")
        code = 128 + signum
    _stop_all(ranks, grace, first=signum)
    _report_stopped(ranks, culprit, out)
    _join_readers(ranks, _READER_JOIN_S)
    return code


def launch(cmd: List[str], nranks: int, *, timeout: Optional[float] = None, grace: float = 3.0,
           prefix: bool = True, env: Optional[Dict[str, str]] = None,
           unique_id: Optional[bytes] = None, stdout: Any = None, stderr: Any = None) -> int:
    """Run `nranks` local copies of `cmd` as one mesh job; return the launcher's exit code.

    `env` adds/overrides variables for every rank; `unique_id` (256 bytes) defaults to
    flagcx_mesh.get_unique_id(); `stdout`/`stderr` are any objects with write (and flush),
    defaulting to sys.stdout/sys.stderr.
    """
    if not cmd:
        raise ValueError("launch: empty command")
    if nranks < 1:
        raise ValueError(f"launch: nranks must be >= 1, got {nranks}")
    uid = _get_unique_id() if unique_id is None else bytes(unique_id)
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"launch: unique id must be {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
    out = _Output(sys.stdout if stdout is None else stdout, sys.stderr if stderr is None else stderr)
    deadline = None if timeout is None else time.monotonic() + timeout
    with _SignalBox() as box:
        ranks, start_error = _start_all(cmd, nranks, uid, env, out, prefix)
        if start_error is not None:
            out.msg(f"cannot start rank {len(ranks)} ({cmd[0]!r}): {start_error}")
            _stop_all(ranks, grace)
            return EXIT_CANNOT_START
        try:
            event, culprit = _supervise(ranks, deadline, box)
            return _finish(event, culprit, ranks, out, grace, timeout, box.received)
        except BaseException:
            _stop_all(ranks, 0.0)  # never leave ranks behind on an unexpected error
            raise


# ----------------------------------------------------------------------------- command line

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(minimum: float, inclusive: bool) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (value >= minimum if inclusive else value > minimum):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if inclusive else '>'} {minimum:g}, got {text}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flagcx_mesh.launch",
        usage="%(prog)s -n N [--timeout S] [--grace G] [--no-prefix] [--] CMD [ARGS...]",
        description="Start N local ranks of CMD sharing one flagcx_mesh unique id.")
    p.add_argument("-n", "--nranks", type=_positive_int, required=True, help="number of ranks")
    p.add_argument("--timeout", type=_seconds(0, inclusive=False), default=None,
                   help="wall-clock limit for the whole job, seconds (exit 124 on expiry)")
    p.add_argument("--grace", type=_seconds(0, inclusive=True), default=3.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 3)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix lines with [rank K]")
    return p


def _command_start(argv: Sequence[str]) -> int:
    """Index where CMD (or the ``--`` before it) begins: the first word that is neither an
    option nor an option's value. Every option but --no-prefix and -h takes a value, either
    in the next word or attached (``-n4``, ``--nranks=4``)."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--" or word == "-" or not word.startswith("-"):
            return i
        attached = "=" in word or (not word.startswith("--") and len(word) > 2)
        i += 1 if word in ("--no-prefix", "-h", "--help") or attached else 2
    return len(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    split = _command_start(argv)  # a "--" later on belongs to the command
    cmd = argv[split + 1:] if split < len(argv) and argv[split] == "--" else argv[split:]
    args = parser.parse_args(argv[:split])  # handles -h and option errors first
    if not cmd:
        parser.error("a command is required (after --)")
    if cmd[0].endswith(".py"):  # a script runs under this interpreter, as torchrun does
        cmd = [sys.executable] + cmd
    from .errors import MeshError  # lazy, as the unique id: no compiled core needed for -h

    try:
        return launch(cmd, args.nranks, timeout=args.timeout, grace=args.grace,
                      prefix=not args.no_prefix)
    except MeshError as e:  # the unique id (e.g. FLAGCX_MESH_IFNAME): one line, not a traceback
        print(f"flagcx_mesh.launch: cannot make the mesh's unique id: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
