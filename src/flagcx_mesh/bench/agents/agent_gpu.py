"""Agents on GPU memory, two processes on one GPU: set-up and request-shaped transfers per device
path, beside Mooncake TE and NIXL and beside the mesh's own puts, all measured in the same run.

    python -m flagcx_mesh.bench agent --device cuda [--memory torch|driver] [--region 256M]
           [--blocks 64K,256K,2M] [--count 256] [--paths cuda-ipc,cuda-vmm,staged] [--bytes 4G]
           [--setups 3] [--connects 20] [--peers mooncake,nixl | none] [--mooncake-protocol nvlink_intra]
           [--mesh-put auto|on|off] [--rounds 2] [--timeout 120] [--target-gpu N] [--json PATH]

For each tool (flagcx_mesh once per path, then each peer) a target process
(_gpu_target.py) starts its endpoint and registers --region bytes of zeroed device memory;
this process, the initiator, learns what it needs over a pipe and measures:

  setup    start, register of a --region device buffer (filled with a random pattern), connect,
           first 4 KiB write (ms), each the median of --setups fresh initiators; the target's start
           and register too; for flagcx_mesh also --connects fresh agents' connect (median, p90)
  request  --count blocks of each --blocks size (wrapping within --region, remote offsets
           reversed) written pipelined (one batch, then its wait) and blocking (a wait per block),
           --bytes per figure, GB/s, the best of --rounds turns; for flagcx_mesh, the mesh's own
           puts of the same blocks (_gpu_mesh.py: the two processes also form a 2-rank mesh
           over the same buffers) take turns with the agent's writes
  verify   the target's buffer, read back (crc32 per MiB), equals what the writes must have left

With staged among --paths, the references of a staged batch follow, measured in the same run
(_staged_refs.py): pinned D2H and H2D copies and raw loopback TCP over 1 and 4 lanes, and each
block size's ratio to min(pinned, raw TCP over the staged connection's lanes) (goal: 0.8 from
64 MiB a batch). staged-host (not among the default paths) is staged into a target region of
host memory: the initiator's gathers and the lanes without the target's scatters (no GPU work
in the target process, as between two hosts), with the same references. --target-gpu N runs
the staged paths' target on another GPU of the host (CUDA_VISIBLE_DEVICES=N in its process, N as
the host numbers its GPUs; the other paths and the peers are NOT RUN then): each end with a GPU
and a PCIe link of its own, as between two hosts, where by default both processes share one GPU.
Each staged line says which GPU (PCI bus) each process used.
Paths: FLAGCX_MESH_CUDA_PATH forced in both processes (ucx: FLAGCX_MESH_TRANSPORT=ucx, with the UCX_TLS
of the bench's environment; not among the default paths); cuda-vmm's target memory is cuMem memory
(torch with expandable segments in the target, or the driver's cuMem). Goals printed as ratios
(above 1: met): register 256 MiB <= 1 ms, connect <= 2 ms, and each path's GB/s at least the
mesh's own puts of the same blocks on that path, measured beside them.
A tool or reference that cannot run is printed as NOT RUN with its reason; the run goes on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib
from typing import Dict, List, Optional

from .. import _gpumem
from . import _gpu_mesh, _gpu_peers, _staged_refs
from .._ranks import save_json
from .._sizes import parse_size, size_name
from ._gpu_child import Target, TargetFailed

PATHS = ("cuda-ipc", "cuda-vmm", "staged")  # the default; "ucx" and "staged-host" may be named too
STAGED = ("staged", "staged-host")  # staged-host: the target's region in host memory (no GPU work there)
TARGET_ONLY = ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")  # a path's env kept out of this process
CRC_CHUNK = 1 << 20
GOAL_REGISTER_MS, GOAL_CONNECT_MS = 1.0, 2.0


def parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench agent --device cuda")
    p.add_argument("--device", choices=("cuda",), default="cuda")
    p.add_argument("--memory", choices=("torch", "driver"), default="torch")
    p.add_argument("--region", default="256M")
    p.add_argument("--blocks", default="64K,256K,2M")
    p.add_argument("--count", type=int, default=256)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--bytes", default="4G", help="bytes moved per bandwidth figure")
    p.add_argument("--setups", type=int, default=3)
    p.add_argument("--connects", type=int, default=20)
    p.add_argument("--peers", default="mooncake,nixl", help="comma-separated, or none")
    p.add_argument("--mooncake-protocol", default="nvlink_intra")
    p.add_argument("--mesh-put", choices=("auto", "on", "off"), default="auto",
                   help="the mesh's own puts beside flagcx_mesh's agent, taking turns with it (auto, on: yes)")
    p.add_argument("--rounds", type=int, default=2, help="turns per figure; each figure is the best turn")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds the target may take per answer")
    p.add_argument("--target-gpu", metavar="N",
                   help="the staged paths' target on this GPU (CUDA_VISIBLE_DEVICES=N in its process)")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    a.region_bytes = parse_size(a.region)
    a.block_sizes = [parse_size(x) for x in a.blocks.split(",") if x]
    a.path_list = [x for x in a.paths.split(",") if x]
    a.peer_list = [] if a.peers.strip() == "none" else [x for x in a.peers.split(",") if x]
    a.total = parse_size(a.bytes)
    return a


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def layout(block: int, count: int, limit: int):
    """(local, remote) offsets of `count` blocks wrapping within `limit`, remote ones reversed;
    blocks that land on one remote slot always come from one local slot (so a batch's outcome
    does not depend on the order its ops complete in)."""
    slots = max(1, min(count, limit // block))
    return [((i % slots) * block, ((count - 1 - i) % slots) * block) for i in range(count)]


class Run:
    """One tool against one target process: the figures and the bytes the target must hold."""

    def __init__(self, args, mem, tool, target: Target, pattern):
        self.args, self.mem, self.tool, self.target, self.pattern = args, mem, tool, target, pattern
        import numpy as np

        self.expected = np.zeros(args.region_bytes, np.uint8)
        self.buf = mem.buffer(args.region_bytes, "ipc")
        self.buf.write(pattern)
        self.info = target.ask({"op": "info"})

    def _write(self, ep, conn, local, pairs, block) -> None:
        self.tool.prepare(ep, conn, local, self.buf, self.info["info"], pairs, block)()
        for s, d in pairs:
            self.expected[d:d + block] = self.pattern[s:s + block]

    def setup_once(self, name: str) -> Dict[str, Optional[float]]:
        t0 = time.perf_counter()
        ep = self.tool.start(name)
        start = _ms(t0)
        local = None
        try:
            t0 = time.perf_counter()
            local = self.tool.register(ep, self.buf)
            reg = _ms(t0)
            t0 = time.perf_counter()
            conn = self.tool.connect(ep, self.info["info"])
            con = _ms(t0) if conn is not None else None
            t0 = time.perf_counter()
            self._write(ep, conn, local, [(0, 0)], 4096)
            first = _ms(t0)
        finally:
            self.tool.close(ep, local)
        return {"agent_start_ms": start, "register_ms": reg, "connect_ms": con, "first_write_ms": first}

    def setup(self) -> Dict[str, Optional[float]]:
        runs = [self.setup_once(f"bench-gpu-init-{k}") for k in range(max(1, self.args.setups))]
        out = {k: (None if runs[0][k] is None else statistics.median(r[k] for r in runs)) for k in runs[0]}
        out["target_start_ms"], out["target_register_ms"] = self.info["start_ms"], self.info["register_ms"]
        if isinstance(self.tool, _gpu_peers.FlagcxTool) and self.args.connects:
            times = sorted(self.setup_once(f"bench-gpu-connect-{i}")["connect_ms"] for i in range(self.args.connects))
            out["connect_median_ms"] = statistics.median(times)
            out["connect_p90_ms"] = times[min(len(times) - 1, int(0.9 * len(times)))]
        return out

    def requests(self) -> Dict[str, Dict]:
        args, tool, out = self.args, self.tool, {}
        ep = tool.start("bench-gpu-init-requests")
        local = beside = None
        try:
            local = tool.register(ep, self.buf)
            conn = tool.connect(ep, self.info["info"])
            self.tcp_lanes = getattr(conn, "tcp_lanes", None)  # ours: the lanes a staged batch is striped over
            if args.mesh_put != "off" and isinstance(tool, _gpu_peers.FlagcxTool):
                beside = _gpu_mesh.MeshBeside(self.target, self.buf, args.timeout)
            for block in args.block_sizes:
                out[size_name(block)] = self.request_row(ep, conn, local, beside, block)
        finally:
            if beside is not None:
                beside.close()
            tool.close(ep, local)
        return out

    def request_row(self, ep, conn, local, beside, block: int) -> Dict:
        """One block size: the tool's (and the mesh's beside it) GB/s, the best of --rounds turns each."""
        args, tool = self.args, self.tool
        pairs = layout(block, args.count, args.region_bytes)
        batch = tool.prepare(ep, conn, local, self.buf, self.info["info"], pairs, block)
        singles = [tool.prepare(ep, conn, local, self.buf, self.info["info"], [p], block) for p in pairs]
        runs = {"agent": (batch, singles)}
        if beside is not None:
            runs["mesh"] = beside.prepare(pairs, block)
        reps = max(1, args.total // (block * len(pairs)))
        moved = block * len(pairs) * reps / 1e9
        best = {name: {"pipelined_GBps": 0.0, "blocking_GBps": 0.0} for name in runs}
        for pipe, _ in runs.values():
            pipe()  # paths chosen, mappings made
        path = tool.path(conn, local, self.info["info"])
        waits = _StagedWaits(self.target) if path == "staged" and isinstance(tool, _gpu_peers.FlagcxTool) else None
        for _ in range(max(1, args.rounds)):
            for name, (pipe, ones) in runs.items():
                b = best[name]
                if waits is not None and name == "agent":
                    waits.start()
                b["pipelined_GBps"] = max(b["pipelined_GBps"], moved / _timed(reps, [pipe]))
                if waits is not None and name == "agent":
                    waits.stop()
                b["blocking_GBps"] = max(b["blocking_GBps"], moved / _timed(reps, ones))
        for s, d in pairs:
            self.expected[d:d + block] = self.pattern[s:s + block]
        row = {"block": block, "path": path, **best["agent"]}
        if waits is not None:
            row["staged_waits"] = waits.summed
        if beside is not None:
            row["mesh"] = {"path": beside.path(), **best["mesh"]}
        return row

    def verify(self) -> str:
        """"ok", or where the target's bytes differ from what the writes must have left."""
        got = self.target.ask({"op": "crc", "chunk": CRC_CHUNK})["crcs"]
        e = self.expected
        want = [zlib.crc32(e[o:o + CRC_CHUNK]) for o in range(0, len(e), CRC_CHUNK)]
        if got == want:
            return "ok"
        bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        return (f"MISMATCH: {len(bad)} of {len(want)} MiB chunks differ, first at byte {bad[0] * CRC_CHUNK}"
                if bad else f"MISMATCH: {len(got)} chunks read back, {len(want)} expected")


class _StagedWaits:
    """Where our staged path waited during the pipelined runs (flagcx_mesh.cuda.staged_waits(),
    docs/gpu.md "Where a staged batch waits"): this process's (the filler's and the lanes'
    sending) and the target's (its lanes' landing), summed over the runs between start() and stop()."""

    def __init__(self, target):
        self.target, self.summed, self._at = target, {"initiator": {}, "target": {}}, None

    def _now(self):
        from ...cuda import staged_waits

        return {"initiator": staged_waits(), "target": self.target.ask({"op": "staged-waits"})["waits"]}

    def start(self) -> None:
        self._at = self._now()

    def stop(self) -> None:
        now = self._now()
        for side, got in now.items():
            acc = self.summed[side]
            for k, v in got.items():
                acc[k] = acc.get(k, 0) + v - self._at[side].get(k, 0)


def _waits_line(w: Dict) -> str:
    """The staged waits of a row, in words."""
    i, t = w["initiator"], w["target"]

    def one(d, n, us):
        return f"{d.get(n, 0)} ({d.get(us, 0) / 1e3:.1f} ms)"

    return (f"the filler waited for ring slots {one(i, 'slot_waits', 'slot_us')}, for gathers "
            f"{one(i, 'gather_waits', 'gather_us')}; lanes with nothing to send {one(i, 'starved', 'starved_us')}; "
            f"the target's lanes for landing buffers {one(t, 'landing_waits', 'landing_us')}")


def _timed(reps: int, calls) -> float:
    """Seconds for `reps` passes over `calls`."""
    t0 = time.perf_counter()
    for _ in range(reps):
        for call in calls:
            call()
    return time.perf_counter() - t0


def measure(args, mem, tool, pattern, label: str, kind: str, env: Dict[str, str]) -> Dict:
    """Every figure of one tool on one path; raises (after closing the target) when it cannot."""
    fig: Dict = {"version": tool.version}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if k not in TARGET_ONLY})
    target = Target(args, tool.name, kind, env)
    try:
        run = Run(args, mem, tool, target, pattern)
        if label in STAGED:
            fig["gpus"] = _gpus_line(label, mem.gpu(), run.info.get("gpu"), run.info.get("visible_devices"))
        s = fig["setup"] = run.setup()
        extra = (f", fresh agents' connect median {s['connect_median_ms']:.2f} / p90 {s['connect_p90_ms']:.2f} ms"
                 if "connect_median_ms" in s else "")
        con = "n/a (none: the first transfer opens the segment)" if s["connect_ms"] is None else f"{s['connect_ms']:.2f} ms"
        print(f"[{label}] start {s['agent_start_ms']:.2f} ms, register {args.region} {s['register_ms']:.3f} ms "
              f"(target {s['target_register_ms']:.3f} ms), connect {con}{extra}, "
              f"first 4 KiB write {s['first_write_ms']:.2f} ms", flush=True)
        fig["request"] = run.requests()
        fig["tcp_lanes"] = getattr(run, "tcp_lanes", None)
        for name, r in fig["request"].items():
            m = r.get("mesh")
            beside = (f"; the mesh's puts beside it over {m['path']}: pipelined {m['pipelined_GBps']:.2f} GB/s, "
                      f"blocking {m['blocking_GBps']:.2f} GB/s" if m else "")
            print(f"[{label}] {args.count} x {name} over {r['path']}: pipelined {r['pipelined_GBps']:.2f} GB/s, "
                  f"blocking {r['blocking_GBps']:.2f} GB/s{beside}", flush=True)
            if "staged_waits" in r:
                print(f"[{label}] {args.count} x {name}, pipelined runs: {_waits_line(r['staged_waits'])}", flush=True)
        fig["verify"] = run.verify()
        print(f"[{label}] bytes at the target: {fig['verify']}", flush=True)
        target.bye()
    finally:
        target.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return fig


def _gpus_line(label: str, mine: Optional[str], theirs: Optional[str], visible: Optional[str]) -> Dict:
    """Which GPU (PCI bus id) each process of a staged run used, printed (`visible`: the target's own
    CUDA_VISIBLE_DEVICES, as it reported it; this process's is in the JSON)."""
    where = f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
    same = " (the same GPU)" if mine and theirs and mine.lower() == theirs.lower() else ""
    print(f"[{label}] GPUs: this process {mine or 'bus unknown'}, the target ({where}) "
          f"{theirs or ('none: its region is host memory' if label == 'staged-host' else 'bus unknown')}{same}",
          flush=True)
    return {"initiator": mine, "target": theirs, "target_visible_devices": visible,
            "initiator_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _path_env(args, path: str) -> Dict[str, str]:
    if args.target_gpu is not None and path not in STAGED:
        raise ValueError(f"--target-gpu {args.target_gpu}: only the staged paths run between two GPUs here")
    if path == "ucx":
        return {"FLAGCX_MESH_TRANSPORT": "ucx"}
    env = {"FLAGCX_MESH_CUDA_PATH": "staged" if path == "staged-host" else path}
    if args.target_gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = args.target_gpu
    if path == "cuda-vmm" and args.memory == "torch":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if not a or not b else a / b


def goals(ours: Dict) -> Dict:
    """Each path's goals as ratios (above 1: met); bandwidth against the mesh's puts beside it."""
    out = {}
    for path, fig in ours.items():
        if "error" in fig:
            continue
        s, g = fig["setup"], {}
        g["register_goal_over_ms"] = _ratio(GOAL_REGISTER_MS, s["register_ms"])
        g["connect_goal_over_ms"] = _ratio(GOAL_CONNECT_MS, s.get("connect_median_ms", s["connect_ms"]))
        for name, r in fig["request"].items():
            ref = r.get("mesh")
            for mode in ("pipelined_GBps", "blocking_GBps"):
                g[f"{name}_{mode}_over_mesh_put"] = _ratio(r[mode], ref and ref[mode])
        out[path] = g
        print(f"[{path}] goals (above 1: met): " + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}"
                                                            for k, v in g.items()), flush=True)
    return out


def compare(ours: Dict, peer: Dict, label: str) -> Dict[str, Optional[float]]:
    """flagcx_mesh / peer (times inverted: above 1 means flagcx_mesh is better)."""
    so, sp = ours["setup"], peer["setup"]
    out: Dict[str, Optional[float]] = {
        "agent_start_ms": _ratio(sp["agent_start_ms"], so["agent_start_ms"]),
        "register_ms": _ratio(sp["register_ms"], so["register_ms"]),
        "connect_first_write": _ratio((sp["connect_ms"] or 0) + sp["first_write_ms"],
                                      (so["connect_ms"] or 0) + so["first_write_ms"])}
    for name, r in ours["request"].items():
        for mode in ("pipelined_GBps", "blocking_GBps"):
            out[f"{name}_{mode}"] = _ratio(r[mode], peer["request"].get(name, {}).get(mode))
    print(f"[{label}] flagcx_mesh / peer (above 1: flagcx_mesh better): "
          + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in out.items()), flush=True)
    return out


def _failed(label: str, e: BaseException) -> Dict[str, str]:
    why = f"{type(e).__name__}: {e}"
    print(f"[{label}] NOT RUN: {why}", flush=True)
    return {"error": why}


def _pattern(n: int):
    import numpy as np

    return np.random.default_rng(12345).integers(0, 256, n, dtype=np.uint8)


def main(argv: List[str]) -> int:
    args = parse(argv)
    mem = _gpumem.make(args.memory)
    pattern = _pattern(args.region_bytes)
    ours_tool = _gpu_peers.FlagcxTool()
    out: Dict = {"device": "cuda", "memory": args.memory, "flagcx_mesh": {}, "peers": {}}
    print(f"versions: {ours_tool.version}; memory from {args.memory}", flush=True)
    for path in args.path_list:
        kind = {"cuda-vmm": "vmm", "staged-host": "host"}.get(path, "ipc")
        try:
            env = _path_env(args, path)
        except ValueError as e:  # (a path that cannot run as asked: said, not failed)
            print(f"[{path}] NOT RUN: {e}", flush=True)
            continue
        try:
            out["flagcx_mesh"][path] = measure(args, mem, ours_tool, pattern, path, kind, env)
        except (Exception, TargetFailed) as e:
            out["flagcx_mesh"][path] = _failed(path, e)
    for name in args.peer_list:
        if args.target_gpu is not None:  # (their figures would be of one GPU, beside ours of two)
            print(f"[{name}] NOT RUN: --target-gpu {args.target_gpu}: the peers run on one GPU only here", flush=True)
            continue
        try:
            tool = _gpu_peers.load(name, args.mooncake_protocol)
            print(f"[{name}] running {tool.version} ({tool.how})", flush=True)
            fig = measure(args, mem, tool, pattern, name, "ipc", {})
        except (Exception, TargetFailed) as e:
            out["peers"][name] = _failed(name, e)
            continue
        fig["ratio"] = {p: compare(o, fig, f"{name} vs flagcx_mesh {p}")  # (staged-host: not into device memory)
                        for p, o in out["flagcx_mesh"].items() if "error" not in o and p != "staged-host"}
        out["peers"][name] = fig
    if args.mesh_put == "off":
        print("[mesh put] NOT RUN: --mesh-put off", flush=True)
    out["copy_GBps"] = {size_name(b): mem.copy_gbps(b * args.count) for b in args.block_sizes}
    for path in STAGED:
        staged = out["flagcx_mesh"].get(path)
        if staged is None or "error" in staged:
            continue
        if "staged_refs" not in out:
            lanes = staged.get("tcp_lanes") or 1
            out["staged_refs"] = _staged_refs.references(mem, max(b * args.count for b in args.block_sizes), lanes)
        key = "ratios" if path == "staged" else "ratios_host"
        out["staged_refs"][key] = _staged_refs.report(staged, out["staged_refs"], args.count, path)
    out["goals"] = goals(out["flagcx_mesh"])
    save_json(out, args.json)
    bad = [p for p, f in out["flagcx_mesh"].items() if "error" in f or f.get("verify") != "ok"]
    bad += [p for p, f in out["peers"].items() if f.get("verify", "ok") != "ok"]
    if bad:
        print(f"FAILED: {', '.join(bad)} (see above)", flush=True)
    return 1 if bad else 0
