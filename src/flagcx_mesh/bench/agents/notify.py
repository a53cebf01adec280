"""How soon the target learns of a write: an 8-byte write with its notification, from the
initiator's call until the target's wait for that notification returns, beside NIXL's in the
same processes and the same run.

    python -m flagcx_mesh.bench notify [--device cpu|cuda] [--paths cma,tcp,cuda-ipc,cuda-vmm]
                                       [--iters 1000] [--rounds 5] [--warmup 20]
                                       [--peers nixl | none] [--memory torch|driver] [--json PATH]

Per path, two processes (an initiator, which this process starts with the path's environment,
and the target it starts) play ping-pong (_notify_ends.py): the initiator writes 8 bytes with a
notification and waits for the target's; the target waits for the initiator's notification and
answers with a write of its own the same way. One way is half a round trip; each figure is the
median and the 99th percentile over --rounds x --iters round trips (after --warmup of each run),
the tools taking turns run by run. flagcx_mesh waits with agent.wait_notification(peer); NIXL is
driven as vLLM's NixlConnector drives it (prepped lists, make_prepped_xfer with notif_msg,
transfer, get_new_notifs polled without pause: the fastest NIXL's notification can be seen).
Every notification carries its value and every slot written is checked (_notify_ends.py).

Paths: cma and tcp on host memory (FLAGCX_MESH_TRANSPORT forced; NIXL with UCX's default
transports for cma, UCX_TLS=tcp for tcp); with --device cuda also cuda-ipc and cuda-vmm on
device memory (FLAGCX_MESH_CUDA_PATH forced; cuda-vmm's memory is cuMem memory: torch with
expandable segments, or --memory driver). NIXL is measured when the nixl package is importable;
otherwise its column is NOT RUN with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

from .._ranks import save_json
from ._notify_ends import TOOLS, Slots

HOST_PATHS, DEVICE_PATHS = ("cma", "tcp"), ("cuda-ipc", "cuda-vmm")


def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench notify")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: device memory paths too (default cpu: host memory only)")
    p.add_argument("--paths", default="", help="comma-separated (default: cma,tcp; with --device cuda also "
                                               "cuda-ipc,cuda-vmm); staged is accepted too")
    p.add_argument("--iters", type=int, default=1000, help="round trips timed per run (default 1000)")
    p.add_argument("--rounds", type=int, default=5, help="runs per tool, the tools taking turns (default 5)")
    p.add_argument("--warmup", type=int, default=20, help="round trips before each run's timed ones (default 20)")
    p.add_argument("--peers", default="nixl", help="nixl, or none")
    p.add_argument("--nixl-progress-thread", choices=("on", "off"), default="on",
                   help="NIXL's progress thread (nixl_agent_config(enable_prog_thread=...)); on: as vLLM runs it")
    p.add_argument("--memory", choices=("torch", "driver"), default="torch",
                   help="device memory from torch or from the CUDA driver (bench/_gpumem.py)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one path may take (default 600)")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    p.add_argument("--path", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.path_list = [x for x in a.paths.split(",") if x] or \
        list(HOST_PATHS + (DEVICE_PATHS if a.device == "cuda" else ()))
    a.peer_list = [] if a.peers.strip() == "none" else [x for x in a.peers.split(",") if x]
    for name in a.peer_list:
        if name not in TOOLS or name == "flagcx_mesh":
            p.error(f"unknown peer {name!r} (known: nixl)")
    return a


def path_env(path: str) -> Dict[str, str]:
    """The environment both processes of a path run with."""
    if path in HOST_PATHS:
        return {"FLAGCX_MESH_TRANSPORT": path, **({"UCX_TLS": "tcp"} if path == "tcp" else {})}
    env = {"FLAGCX_MESH_CUDA_PATH": path}
    if path == "cuda-vmm":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def _memory_kind(path: str) -> str:
    return "vmm" if path == "cuda-vmm" else "ipc"


def _device(path: str) -> str:
    return "cpu" if path in HOST_PATHS else "cuda"


# ---------------------------------------------------------------- the two processes of a path

def _send(stream, msg: dict) -> None:
    stream.write(json.dumps(msg) + "\n")
    stream.flush()


def _recv(stream, who: str) -> dict:
    line = stream.readline()
    if not line:
        raise RuntimeError(f"bench notify: the {who} process ended without answering")
    return json.loads(line)


def _ends(args, role: str) -> Dict[str, object]:
    """Each tool's end in this process, or the reason it cannot run (a str)."""
    slots = Slots(args.iters + args.warmup, _device(args.path), args.memory, _memory_kind(args.path))
    ends: Dict[str, object] = {}
    for name in ["flagcx_mesh", *args.peer_list]:
        try:
            ends[name] = TOOLS[name](role, slots, args.nixl_progress_thread == "on")
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            ends[name] = f"{type(e).__name__}: {e}"
    if isinstance(ends["flagcx_mesh"], str):
        raise RuntimeError(f"bench notify: flagcx_mesh's end cannot start: {ends['flagcx_mesh']}")
    return ends


def _hello(ends: Dict[str, object]) -> Dict[str, dict]:
    return {n: ({"error": e} if isinstance(e, str) else e.hello()) for n, e in ends.items()}


def _meet(ends: Dict[str, object], theirs: Dict[str, dict]) -> None:
    """Introduces each end to its peer's; an end whose peer's cannot run (or that cannot meet it)
    becomes the reason."""
    for name, end in list(ends.items()):
        info = theirs.get(name, {"error": "not started there"})
        if isinstance(end, str):
            continue
        if "error" in info:
            ends[name] = f"the other process's end cannot run: {info['error']}"
            continue
        try:
            end.meet(info)
        except Exception as e:  # noqa: BLE001
            ends[name] = f"{type(e).__name__}: {e}"


def _own_stdout():
    """This process's stdout, for the bench's own lines alone: what the libraries print goes to stderr."""
    sys.stdout.flush()
    ours = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return ours


def target(args) -> int:
    """The target: answers each round trip of the runs the initiator announces on stdin."""
    out = _own_stdout()
    ends = _ends(args, "target")
    _send(out, {"hello": _hello(ends)})
    _meet(ends, _recv(sys.stdin, "initiator")["hello"])
    _send(out, {"ready": {n: (e if isinstance(e, str) else "") for n, e in ends.items()}})
    while True:
        cmd = _recv(sys.stdin, "initiator")
        if "stop" in cmd:
            break
        end, run = ends[cmd["tool"]], cmd["run"]
        end.slots.fill(run, 1)
        _send(out, {"filled": True})
        try:
            for i in range(args.warmup + args.iters):
                end.pong(run, i)
            end.settle()
            end.slots.verify(run, 0)
            _send(out, {"done": ""})
        except Exception as e:  # noqa: BLE001
            _send(out, {"done": f"{type(e).__name__}: {e}"})
    for end in ends.values():
        if not isinstance(end, str):
            end.close()
    return 0


def _run(args, end, run: int, child) -> List[int]:
    """One run: the round trips' times (ns) after the warm-up; raises what failed at either end."""
    _send(child.stdin, {"tool": end.name, "run": run})
    _recv(child.stdout, "target")  # its half filled
    end.slots.fill(run, 0)
    times = []
    try:
        for i in range(args.warmup + args.iters):
            t0 = time.perf_counter_ns()
            end.ping(run, i)
            times.append(time.perf_counter_ns() - t0)
        end.settle()
    finally:  # the target's word on the run, whatever happened here (it gives up within WAIT_S)
        err = _recv(child.stdout, "target")["done"]
    if err:
        raise RuntimeError(f"at the target: {err}")
    end.slots.verify(run, 1)
    return times[args.warmup:]


def _figures(samples: List[int]) -> Dict[str, float]:
    one_way = sorted(t / 2e3 for t in samples)  # µs
    return {"median_us": statistics.median(one_way), "p99_us": one_way[min(len(one_way) - 1, int(0.99 * len(one_way)))],
            "round_trips": len(one_way)}


def initiator(args) -> int:
    """Starts the target, plays the runs, prints the figures as one JSON line."""
    out = _own_stdout()
    cmd = [sys.executable, "-m", "flagcx_mesh.bench", "notify", "--role", "target", "--path", args.path,
           "--iters", str(args.iters), "--warmup", str(args.warmup), "--memory", args.memory,
           "--peers", ",".join(args.peer_list) or "none", "--nixl-progress-thread", args.nixl_progress_thread]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ends = _ends(args, "initiator")
        _meet(ends, _recv(child.stdout, "target")["hello"])
        _send(child.stdin, {"hello": _hello(ends)})
        for name, why in _recv(child.stdout, "target")["ready"].items():
            if why and not isinstance(ends[name], str):
                ends[name] = why
        figures = _play(args, ends, child)
        _send(child.stdin, {"stop": True})
        child.wait(timeout=60)
        for end in ends.values():
            if not isinstance(end, str):
                end.close()
        _send(out, figures)
        return 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _play(args, ends: Dict[str, object], child) -> Dict[str, dict]:
    samples: Dict[str, List[int]] = {n: [] for n in ends}
    out: Dict[str, dict] = {n: {"error": e} for n, e in ends.items() if isinstance(e, str)}
    for r in range(args.rounds):
        for k, (name, end) in enumerate(ends.items()):
            if name in out:
                continue
            try:
                samples[name] += _run(args, end, r * len(ends) + k, child)
            except Exception as e:  # noqa: BLE001
                if name == "flagcx_mesh":
                    raise
                out[name] = {"error": f"{type(e).__name__}: {e}"}
    for name, end in ends.items():
        if name not in out:
            out[name] = {**_figures(samples[name]), "path": end.path(), "checked": "every slot"}
    return out


# ---------------------------------------------------------------- main: one initiator per path

def _measure(args, path: str) -> Dict[str, dict]:
    cmd = [sys.executable, "-m", "flagcx_mesh.bench", "notify", "--role", "initiator", "--path", path,
           "--iters", str(args.iters), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
           "--memory", args.memory, "--peers", ",".join(args.peer_list) or "none",
           "--nixl-progress-thread", args.nixl_progress_thread]
    env = dict(os.environ, **path_env(path))
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {args.timeout:.0f} s"}
    if p.returncode != 0 or not p.stdout.strip():
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"the initiator failed (exit {p.returncode}): {tail}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _ratio(row: Dict[str, dict], peer: str) -> Optional[float]:
    ours, theirs = row.get("flagcx_mesh", {}), row.get(peer, {})
    if "median_us" not in ours or "median_us" not in theirs:
        return None
    return theirs["median_us"] / ours["median_us"]


def _report(data: dict, args) -> None:
    print(f"notification of an 8-byte write, one way (half a ping-pong round trip), µs: median / p99 of "
          f"{args.rounds} x {args.iters} round trips per tool, the tools taking turns run by run")
    head = f"  {'path':>9}{'taken':>10}{'flagcx_mesh':>13}{'p99':>8}"
    for peer in args.peer_list:
        head += f"{peer:>10}{'p99':>8}{peer + '/ours':>11}  {peer}'s transports"
    print(head)
    for path, row in data["paths"].items():
        ours = row.get("flagcx_mesh", row)
        if "error" in ours:
            print(f"  {path:>9}: FAILED: {ours['error']}")
            continue
        line = f"  {path:>9}{ours['path']:>10}{ours['median_us']:>13.1f}{ours['p99_us']:>8.1f}"
        for peer in args.peer_list:
            f = row[peer]
            if "error" in f:
                line += f"  [{peer}] NOT RUN: {f['error']}"
                continue
            line += f"{f['median_us']:>10.1f}{f['p99_us']:>8.1f}{_ratio(row, peer):>11.2f}  {f['path']}"
        print(line)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    if args.role == "target":
        return target(args)
    if args.role == "initiator":
        return initiator(args)
    data = {"device": args.device, "iters": args.iters, "rounds": args.rounds,
            "paths": {p: _measure(args, p) for p in args.path_list}}
    for row in data["paths"].values():
        for peer in args.peer_list:
            row.setdefault(f"{peer}_over_flagcx_mesh", _ratio(row, peer))
    _report(data, args)
    save_json(data, args.json)
    failed = [p for p, row in data["paths"].items() if "error" in row.get("flagcx_mesh", row)]
    return 1 if failed else 0
