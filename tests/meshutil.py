"""Helpers shared by the flagcx_mesh tests: ranks as threads, listening ports, fd counts, test
programs in processes of their own and the files they exchange (standard library only: the
vLLM venv's tests use it too)."""

from __future__ import annotations

import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK_PROG = os.path.join(REPO_ROOT, "tests", "rank_prog.py")
PY = sys.executable


def run_threads(n: int, fn: Callable[[int], Any], timeout: float,
                collect: bool = False) -> List[Any]:
    """Run fn(rank) for rank in 0..n-1, each in its own thread.

    Joins with one overall `timeout`; if any thread is still alive then, raises
    AssertionError naming the stuck ranks (the threads are daemons, so a stuck
    one cannot keep the interpreter alive). Otherwise returns the results in
    rank order; with collect=False the first exception raised (in time) is
    re-raised instead, with collect=True exceptions are returned in place of
    results.
    """
    results: List[Any] = [None] * n
    errors: List[Tuple[float, int, BaseException]] = []
    lock = threading.Lock()

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            with lock:
                errors.append((time.monotonic(), rank, e))
            results[rank] = e

    threads = [threading.Thread(target=body, args=(r,), name=f"rank {r}", daemon=True)
               for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise AssertionError(f"ranks {stuck} of {n} still running after {timeout} s (hang)")
    if errors and not collect:
        errors.sort(key=lambda e: e[0])
        raise errors[0][2]
    return results


def wait_for(cond: Callable[[], bool], timeout: float, step: float = 0.02) -> bool:
    """Poll cond() until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


# ----------------------------------------------------------------------------- sockets

def _hex_ip(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    # /proc/net/tcp{,6} print the address as 32-bit words in host (little-endian) order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return socket.inet_ntop(socket.AF_INET, words)
    return socket.inet_ntop(socket.AF_INET6, words)


def tcp_addresses(pid: int, state: Optional[str] = None) -> Set[Tuple[str, int]]:
    """(host, port) of the local end of every TCP socket process `pid` holds (in `state` only,
    a /proc/net/tcp state code such as "0A" for LISTEN, when given).

    Read from /proc/net/tcp and /proc/net/tcp6, keeping the sockets whose inode appears among
    the process's file descriptors.
    """
    mine = socket_inodes(pid)
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or (state is not None and cols[3] != state):
                continue
            if int(cols[9]) not in mine:
                continue
            host_hex, port_hex = cols[1].split(":")
            found.add((_hex_ip(host_hex), int(port_hex, 16)))
    return found


def listening_ports() -> Set[Tuple[str, int]]:
    """(host, port) of every TCP socket in LISTEN state owned by this process."""
    return tcp_addresses(os.getpid(), "0A")


def parse_hostport(text: str) -> Tuple[str, int]:
    """'192.0.2.2:4711' or '[::1]:4711' -> (host, port)."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def connect(addr: Tuple[str, int], timeout: float = 5.0) -> socket.socket:
    """A blocking TCP client connected to addr (IPv4 or IPv6)."""
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(addr)
    return s


def recv_up_to(s: socket.socket, n: int) -> bytes:
    """Up to n bytes from s: fewer only when the peer closed first (s's timeout bounds each read)."""
    got = b""
    while len(got) < n:
        part = s.recv(n - len(got))
        if not part:
            break
        got += part
    return got


def proc_state(pid: int) -> str:
    """Process `pid`'s one-letter state ("R", "S", "T" stopped, "Z", ...) from /proc/PID/stat
    (OSError once the process is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def wait_stopped(pid: int, what: str, timeout: float = 10.0) -> None:
    """Returns once process `pid` is stopped (SIGSTOP delivered); fails naming `what` after
    `timeout` seconds."""
    end = time.monotonic() + timeout
    while proc_state(pid) != "T":
        assert time.monotonic() < end, f"{what} did not stop"
        time.sleep(0.001)


def socket_inodes(pid: int) -> Set[int]:
    """The inodes of the sockets process `pid` holds (its /proc/PID/fd links "socket:[N]")."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # (closed since the listing)
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def stream_fds():
    """(fd, a socket object on a duplicate of it) for each connected stream socket of this process
    (the caller closes the sockets it keeps; the others are closed here)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = os.dup(int(name))
        except OSError:  # (closed since the listing)
            continue
        try:
            s = socket.socket(fileno=fd)
        except OSError:  # not a socket: the duplicate is closed here (it was left open, and each
            os.close(fd)  # call doubled the process's other descriptors: 20000 after a few tests)
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.getpeername():
                yield int(name), s
                continue
        except OSError:
            pass
        s.close()


def stream_sockets():
    """A socket object on a duplicate of each connected stream fd of this process (the caller
    closes those it keeps; the others are closed here)."""
    for _, s in stream_fds():
        yield s


def lane_sockets(listener_address: Optional[str] = None) -> List[socket.socket]:
    """A duplicate of each socket of this process (connected to `listener_address` when given: a
    connector's lanes), one per lane: each lane has two fds, one the engine writes and its dup
    it reads. The caller closes them."""
    port = int(listener_address.rsplit(":", 1)[1]) if listener_address else None
    out, seen = [], set()
    for s in stream_sockets():
        if (port is None or s.getpeername()[1] == port) and s.getsockname() not in seen:
            seen.add(s.getsockname())
            out.append(s)
        else:
            s.close()
    return out


def shut_lane(socks: List[socket.socket], lane: int) -> None:
    """Shuts the connection of lane `lane` (the lanes' local ports in order) and closes every
    socket of `socks` (lane_sockets' duplicates)."""
    ports = sorted(s.getsockname()[1] for s in socks)
    victim = next(s for s in socks if s.getsockname()[1] == ports[lane])
    victim.shutdown(socket.SHUT_RDWR)
    for s in socks:
        s.close()


def fail_with_peer_lost(handles, who: str, timeout: float) -> None:
    """The handles fail with PeerLost naming `who` (the first that fails), within `timeout` s."""
    from flagcx_mesh import PeerLost  # (meshutil imports no flagcx_mesh at its top)

    t0 = time.monotonic()
    try:
        for h in handles:
            h.wait(timeout)
    except PeerLost as e:
        assert who in str(e), e
    else:
        raise AssertionError("every handle completed: PeerLost expected")
    assert time.monotonic() - t0 < timeout, f"PeerLost came after {time.monotonic() - t0:.1f} s"


def bytes_acked(sock: socket.socket) -> int:
    """tcpi_bytes_acked of struct tcp_info (Linux >= 4.1): bytes the peer has acknowledged."""
    return struct.unpack_from("<Q", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256), 120)[0]


def acked_since(socks, before, each: int, limit: float = 5.0) -> List[int]:
    """Bytes each socket had acknowledged since `before` (its earlier bytes_acked), once each
    reached `each` or after `limit` s: a transfer's completion can come back before the kernel's
    (delayed) ACK of a socket's last segments, and the sum passes a size before the last socket's
    count does (every socket also carries frame headers)."""
    deadline = time.monotonic() + limit
    while True:
        sent = [bytes_acked(s) - b for s, b in zip(socks, before)]
        if all(n >= each for n in sent) or time.monotonic() > deadline:
            return sent
        time.sleep(0.01)


# ----------------------------------------------------------------------------- process resources

def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def take_every_descriptor(limit: int = 1024) -> List[int]:
    """Lowers this process's RLIMIT_NOFILE soft limit to `limit` (or keeps a lower one) and opens
    /dev/null until no descriptor is left: an accept() then fails with EMFILE. Returns the
    descriptors taken (os.close them to free them)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, limit), hard))
    taken = []
    try:
        while True:
            taken.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    return taken


def raise_nofile_limit() -> None:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (many ranks in one process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def package_root() -> str:
    """The directory holding the flagcx_mesh package this process imported (an install's
    site-packages, or a development tree), so child processes test the same one."""
    import flagcx_mesh
    return os.path.dirname(os.path.dirname(os.path.abspath(flagcx_mesh.__file__)))


def subprocess_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """os.environ with the tested package's root and tests/ first on PYTHONPATH (so rank
    processes import the same flagcx_mesh and can import meshutil), unbuffered output."""
    env = dict(os.environ)
    old = env.get("PYTHONPATH")
    first = os.pathsep.join([package_root(), os.path.join(REPO_ROOT, "tests")])
    env["PYTHONPATH"] = first + (os.pathsep + old if old else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def thread_meshes(n: int = 2, contexts: int = 1) -> List[Any]:
    """n ranks of one mesh as threads of this process (a 30 s mesh timeout)."""
    import flagcx_mesh
    uid = flagcx_mesh.get_unique_id()
    return run_threads(n, lambda r: flagcx_mesh.Mesh(n, uid, r, contexts=contexts, timeout=30), timeout=45)


def close_all(meshes) -> None:
    for m in meshes:
        m.close()


# ----------------------------------------------------------------------------- test programs

OUTPUT_TAIL = 4000  # characters of each stream a failure message carries


def spawn_prog(prog: str, *args, env: Optional[Dict[str, str]] = None, merge: bool = False,
               stdin=None, cwd: Optional[str] = None) -> subprocess.Popen:
    """python PROG ARGS... (each argument str()-ed) with text stdout and stderr piped (stderr
    into stdout with merge=True); finish_prog() waits for it."""
    return subprocess.Popen([PY, prog, *map(str, args)], env=env, cwd=cwd, stdin=stdin, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else subprocess.PIPE)


def finish_prog(p: subprocess.Popen, rc: int = 0, timeout: float = 90.0, what: Any = None,
                ok: Optional[str] = None) -> Tuple[str, str]:
    """(stdout, stderr) of p once it exited (stderr "" when merged). Fails the test if p runs
    past `timeout` (then killed), exits other than `rc`, or (ok given) prints no `ok` on stdout;
    the message names `what` (default: the program's arguments) with the end of its output."""
    import pytest

    what = p.args[2:] if what is None else what
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"{what} did not finish in {timeout} s:\n{_tails(out, err)}")
    assert p.returncode == rc, f"{what} exited {p.returncode}, not {rc}:\n{_tails(out, err)}"
    assert ok is None or ok in out, f"{what} printed no {ok!r}:\n{_tails(out, err)}"
    return out, err or ""


def _tails(out: str, err: Optional[str]) -> str:
    return out[-OUTPUT_TAIL:] + (f"\n{err[-OUTPUT_TAIL:]}" if err else "")


def publish(d: str, name: str, data: bytes) -> None:
    """Writes file d/name whole (a temporary file renamed), so a reader never sees part of it."""
    tmp = os.path.join(d, name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(d, name))


def read_published(d: str, name: str, timeout: float = 30.0) -> bytes:
    """The bytes of d/name (see publish()) once it exists; a test program that waited `timeout`
    seconds for it in vain exits (SystemExit) naming it."""
    path, end = os.path.join(d, name), time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit(f"FAILED: {path} never appeared")
        time.sleep(0.01)
    with open(path, "rb") as f:
        return f.read()


def wait_file(path, timeout: float = 30) -> bytes:
    """The bytes of `path` once it exists (a peer process publishes it); fails after `timeout`."""
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.01)
    with open(path, "rb") as f:
        return f.read()


def wait_rejected(agent: Any, reason: str, at_least: int = 1, limit: float = 20.0) -> int:
    """Polls an agent's listener counters until `reason` reaches `at_least` (bounded, not timed)."""
    end = time.monotonic() + limit
    while True:
        got = agent.stats()["rejected"].get(reason, 0)
        if got >= at_least or time.monotonic() > end:
            return got
        time.sleep(0.02)
