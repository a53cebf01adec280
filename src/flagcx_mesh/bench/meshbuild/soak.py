"""Soak: many mesh builds (ranks as threads) with jitter, foreign traffic and killed ranks.

    python -m flagcx_mesh.bench soak [--builds 10000] [--min-ranks 2] [--max-ranks 32]
                                     [--jitter-ms 20] [--kill 0.2] [--absent 0.01]
                                     [--foreign 0.3] [--timeout 5] [--seed 1] [--max-seconds S]
                                     [--json PATH]

Each build draws n in [min, max] ranks, runs them as threads of this process, each after a
random 0..J ms delay. With probability --kill one rank abandons the build: it raises out of
the build at a random phase (after the rendezvous or after connecting), so its sockets close
mid-build. With probability --absent one rank never calls at all (the others wait out
--timeout, so keep it rare). With probability --foreign strangers connect during the build:
up to 8 to the rendezvous root while the ranks join, and 1 to 6 to the ranks' listeners (found
through /proc/self/fd) once the addresses are gathered; each sends garbage bytes, nothing, or 64 random
bytes (a forged header).

Outcomes: a build is hung when a rank is still inside after timeout + 20 s; miswired when
a built mesh delivers a tagged message from another (rank, mesh) than its slot says;
failed when a rank raised. Every failure is classified by error type and message shape,
and must name a peer (a rank number in the message or the error's peer): a failure with
no peer named is counted as unnamed, a defect. A build with no injected fault that fails
is counted separately. No figure is asserted here: the test (tests/test_soak.py) runs a
short version and asserts 0 hangs, 0 miswirings, 0 unnamed failures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import socket
import threading
import time
from typing import Any, Dict, List, Optional

from ... import _core
from ...mesh import Mesh, get_unique_id, release_unique_id
from .._ranks import save_json

HANG_GRACE_S = 20.0
PHASES = ("rendezvous", "connect")  # after listen = before joining: that is --absent


class Abandon(Exception):
    """Raised by the killed rank's phase hook: the rank leaves the build there."""


def _message_class(e: BaseException) -> str:
    text = str(e).split("\n")[0]
    text = re.sub(r"Abandon: .*", "Abandon: (the injected failure)", text)
    text = re.sub(r"\d+\.\d+\.\d+\.\d+:\d+", "ADDR", text)
    text = re.sub(r"[0-9a-f]{8,}", "HEX", text)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    return f"{type(e).__name__}: {text[:110]}"


def _names_a_peer(e: BaseException, rank: int, n: int) -> bool:
    """Whether the error of `rank` names another rank: its peer, or "peer K" / "rank K" /
    "ranks [K" in the message for some K != rank (its own "rank R:" prefix does not count)."""
    peer = getattr(e, "peer", -1)
    if isinstance(peer, int) and 0 <= peer < n and peer != rank:
        return True
    found = re.findall(r"\b(?:peer|rank)s? \[?(\d+)", str(e))
    return any(int(k) != rank and int(k) < n for k in found)


def _listening_ports() -> List[int]:
    """Ports this process listens on over TCP (the ranks' listeners and the roots): every
    socket fd, asked through a duplicate whether it accepts connections."""
    ports = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:["):
                continue
            with socket.socket(fileno=os.dup(int(fd))) as s:  # closes the duplicate only
                if s.type == socket.SOCK_STREAM and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    ports.append(s.getsockname()[1])
        except OSError:
            continue  # closed meanwhile, or not an inet socket
    return ports


def _stranger(host: str, port: int, rng: random.Random) -> Optional[socket.socket]:
    """One foreign connection: garbage bytes, silence, or 64 random bytes (a forged header)."""
    try:
        s = socket.create_connection((host, port), timeout=1)
        kind = rng.randrange(3)
        if kind == 0:
            s.sendall(os.urandom(rng.randrange(1, 200)))
        elif kind == 2:
            s.sendall(os.urandom(64))
        return s
    except OSError:
        return None  # that listener closed meanwhile


def _at_root(host: str, port: int, stop: threading.Event, rng: random.Random, socks: list) -> None:
    """Strangers at the rendezvous root while the ranks join."""
    while not stop.is_set() and len(socks) < 8:
        socks.append(_stranger(host, port, rng))
        stop.wait(rng.uniform(0.001, 0.01))


def _at_listeners(host: str, root_port: int, rng: random.Random, socks: list) -> None:
    """A burst of strangers at the ranks' listeners (found through /proc/self/fd), sent from
    one rank's hook once the addresses are gathered, so they arrive while the ranks connect."""
    ports = [p for p in _listening_ports() if p != root_port]
    for _ in range(rng.randint(1, 6)):
        if ports:
            socks.append(_stranger(host, rng.choice(ports), rng))


def _check_wiring(meshes: List[Mesh]) -> int:
    """Tagged messages on every (src, dst): how many arrived from the wrong rank or mesh."""
    n, bad = len(meshes), [0]

    def body(r):
        m = meshes[r]
        for p in range(n):
            m.send(p, f"{m.mesh_id}|{r}->{p}".encode())
        for p in range(n):
            if m.recv(p, timeout=20) != f"{m.mesh_id}|{p}->{r}".encode():
                bad[0] += 1

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return bad[0] + sum(t.is_alive() for t in threads)


def one_build(i: int, args: argparse.Namespace, rng: random.Random) -> Dict[str, Any]:
    n = rng.randint(args.min_ranks, args.max_ranks)
    victim = rng.randrange(n) if rng.random() < args.kill else -1
    absent = rng.randrange(n) if victim < 0 and rng.random() < args.absent else -1
    kill_phase = rng.choice(PHASES)
    uid = get_unique_id()
    results: List[Any] = [None] * n
    delays = [rng.uniform(0, args.jitter_ms / 1000) for _ in range(n)]

    foreign = rng.random() < args.foreign
    injector = min(r for r in range(n) if r not in (victim, absent))
    host, port = _core._unique_id_info(uid)["root"].rsplit(":", 1)
    frng, socks = random.Random(rng.random()), []

    def hook_of(r: int):
        def hook(phase: str) -> None:
            if foreign and r == injector and phase == "rendezvous":
                _at_listeners(host, int(port), frng, socks)
            if r == victim and phase == kill_phase:
                raise Abandon(f"rank abandons the build after {phase}")
        return hook

    def body(r: int) -> None:
        time.sleep(delays[r])
        try:
            results[r] = Mesh(n, uid, r, timeout=args.timeout, _on_phase=hook_of(r))
        except BaseException as e:  # noqa: BLE001 - classified below
            results[r] = e

    stop = threading.Event()
    helpers = [threading.Thread(target=_at_root, args=(host, int(port), stop, frng, socks), daemon=True)] if foreign else []
    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n) if r != absent]
    t0 = time.monotonic()
    for t in helpers + threads:
        t.start()
    for t in threads:
        t.join(max(0.0, t0 + args.timeout + HANG_GRACE_S - time.monotonic()))
    stop.set()
    for t in helpers:
        t.join(5)
    for sock in socks:
        if sock is not None:
            sock.close()
    took = time.monotonic() - t0
    out = {"build": i, "n": n, "victim": victim, "absent": absent, "foreign": foreign,
           "seconds": round(took, 3), "hung": sum(t.is_alive() for t in threads)}
    meshes = [m for m in results if isinstance(m, Mesh)]
    errors = [(r, e) for r, e in enumerate(results) if isinstance(e, BaseException) and r != victim]
    out["failures"] = [{"rank": r, "class": _message_class(e), "named": _names_a_peer(e, r, n), "message": str(e)[:300]}
                       for r, e in errors]
    out["ok"] = len(meshes) == n
    out["miswired"] = _check_wiring(meshes) if out["ok"] else 0
    out["rejected"] = sum(m.stats()["rejected_total"] for m in meshes)  # strangers the listeners closed
    for m in meshes:
        m.close()
    release_unique_id(uid)
    return out


def summarize(builds: List[Dict[str, Any]], seconds: float) -> Dict[str, Any]:
    classes = collections.Counter(f["class"] for b in builds for f in b["failures"])
    unnamed = [f for b in builds for f in b["failures"] if not f["named"]]
    faulty = [b for b in builds if b["victim"] >= 0 or b["absent"] >= 0]
    return {
        "builds": len(builds), "seconds": round(seconds, 1),
        "built": sum(b["ok"] for b in builds),
        "with_killed_rank": sum(b["victim"] >= 0 for b in builds),
        "with_absent_rank": sum(b["absent"] >= 0 for b in builds),
        "with_foreign_traffic": sum(b["foreign"] for b in builds),
        "faulty_builds_that_built": sum(b["ok"] for b in faulty),
        "clean_builds_that_failed": sum(not b["ok"] for b in builds if b["victim"] < 0 and b["absent"] < 0),
        "hangs": sum(b["hung"] > 0 for b in builds),
        "miswirings": sum(b["miswired"] > 0 for b in builds),
        "failures": sum(len(b["failures"]) for b in builds),
        "foreign_connections_rejected": sum(b["rejected"] for b in builds),
        "unnamed_failures": len(unnamed),
        "unnamed_examples": [f["message"] for f in unnamed[:5]],
        "failure_classes": dict(classes.most_common()),
        "max_build_seconds": max((b["seconds"] for b in builds), default=0.0),
        "threads_end": len(os.listdir("/proc/self/task")), "fds_end": len(os.listdir("/proc/self/fd")),
    }


def _print(s: Dict[str, Any]) -> None:
    print(f"soak: {s['builds']} builds in {s['seconds']} s; built {s['built']}; "
          f"killed-rank builds {s['with_killed_rank']} (of which built {s['faulty_builds_that_built']}), "
          f"absent-rank builds {s['with_absent_rank']}, foreign traffic {s['with_foreign_traffic']} "
          f"({s['foreign_connections_rejected']} foreign connections rejected by built meshes' listeners)")
    print(f"  hangs {s['hangs']}  miswirings {s['miswirings']}  failures {s['failures']}  "
          f"unnamed failures {s['unnamed_failures']}  clean builds that failed {s['clean_builds_that_failed']}  "
          f"slowest build {s['max_build_seconds']} s  threads/fds at end {s['threads_end']}/{s['fds_end']}")
    for cls, count in s["failure_classes"].items():
        print(f"  {count:6d}  {cls}")
    for m in s["unnamed_examples"]:
        print(f"  UNNAMED: {m}")


def parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", type=int, default=10000, help="meshes to build (default 10000)")
    p.add_argument("--min-ranks", type=int, default=2, help="fewest ranks (threads) of a build (default 2)")
    p.add_argument("--max-ranks", type=int, default=32, help="most ranks (threads) of a build (default 32)")
    p.add_argument("--jitter-ms", type=float, default=20.0, help="each rank starts up to this late, milliseconds (default 20)")
    p.add_argument("--kill", type=float, default=0.2, help="probability that one rank abandons a build")
    p.add_argument("--absent", type=float, default=0.01, help="probability that one rank never calls")
    p.add_argument("--foreign", type=float, default=0.3, help="probability of foreign traffic at the root")
    p.add_argument("--timeout", type=float, default=5.0, help="build deadline, seconds")
    p.add_argument("--seed", type=int, default=1, help="seed of the random choices (default 1): a run is repeatable")
    p.add_argument("--max-seconds", type=float, default=0, help="stop after this long (0: run every build)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures to PATH as JSON")
    p.add_argument("--progress", type=int, default=100, help="print a line every K builds (0: never)")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv or [])
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass
    rng = random.Random(args.seed)
    builds, t0 = [], time.monotonic()
    for i in range(args.builds):
        if args.max_seconds and time.monotonic() - t0 > args.max_seconds:
            print(f"soak: stopped after {args.max_seconds:g} s (--max-seconds), {i} of {args.builds} builds")
            break
        builds.append(one_build(i, args, rng))
        if builds[-1]["hung"]:
            print(f"soak: build {i} HUNG ({builds[-1]}); stopping")
            break
        if args.progress and (i + 1) % args.progress == 0:
            s = summarize(builds, time.monotonic() - t0)
            print(f"soak: {i + 1} builds, {s['seconds']} s, hangs {s['hangs']}, miswirings {s['miswirings']}, "
                  f"unnamed {s['unnamed_failures']}", flush=True)
    s = summarize(builds, time.monotonic() - t0)
    _print(s)
    save_json(dict(s, args=vars(args)), args.json)
    return 0 if s["hangs"] == 0 and s["miswirings"] == 0 and s["unnamed_failures"] == 0 else 1
