"""One request's KV, prefill -> decode, through the vLLM connector's transfer part, beside a
contiguous agent write of the same bytes on the same path, measured in the same run.

    python -m flagcx_mesh.bench kv [--device cpu|cuda] [--tokens 2048,8192] [--paths cma,tcp]
                                   [--layers 32] [--heads 8] [--head-size 128] [--block-size 16]
                                   [--reps 5] [--peers nixl,mooncake | none] [--json PATH] [--plot PNG]
                                   [--pull on|off] [--steps] [--busy-decode] [--busy-prefill]

The shape defaults to an 8B model's (32 layers, 8 KV heads, head size 128, bf16, blocks of 16
tokens: 64 KiB per block and layer, 128 KiB per token) in vLLM 0.33's layout. This process is
the prefill (flagcx_mesh.vllm.transfer.KVTransfer holding a request's blocks); a child process
is the decode, which fetches them into blocks of its own. Block ids are shuffled on both sides
(nothing merges: one 64 KiB op per block and layer, as in a long-running engine). Time: from
the decode's fetch to its completion (data landed and notified), median of --reps requests. The
first request on the connection is pushed by the prefill; with --pull on (the default, as the
connector) the decode reads the later ones itself where the path moves bytes on this host
(transfer.py), with --pull off every one is pushed; how many were pushed is printed.
The references, measured in the same run: the same bytes as one contiguous write per layer
between two plain agents of the same processes (registered buffers as large as the caches; each
layer's share to bytes of its own, so that the reference moves as many distinct bytes as the
request), over the same forced path, interleaved with the requests, median of --reps (the ratio
KV / contiguous); between them, the agents' own share: the same blocks (shuffled the same way,
between the plain agents' buffers) as one batch_write per layer of op lists built beforehand,
median of --reps, and batch / contiguous (GB/s over GB/s: 1.0 is a batch as fast as the
contiguous write); and, in the prefill process alone, the local gather of the same blocks (per
layer, `index_copy_` of the blocks picked with `index_select`, on the cache viewed as uint8 and
as int64; median of --reps), which no transfer between processes can beat (gather u8 / KV: 1.0
is a request as fast as the uint8 gather). Paths are forced with FLAGCX_MESH_TRANSPORT (host: cma,
tcp) or FLAGCX_MESH_CUDA_PATH (cuda: cuda-ipc, cuda-vmm, staged); cuda-vmm is measured in a process
of its own with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (its memory must be cuMem memory, which
torch's allocator gives only when set before CUDA starts) unless this one has it. With --peers (default
nixl,mooncake), NIXL and Mooncake TE move the same blocks (one batch of blocks x layers blocks of a
layer's block bytes, scattered) through `bench agent`'s harness, started by this run after the
paths (kv_peers.py): their ms per request beside the KV request's; a peer not installed is
printed NOT RUN with its reason. Over cma, the kernel alone too (_rawcma.py): the batch's blocks
and the contiguous write's layers as iovecs of straight `process_vm_writev` calls between the same
two buffers, median of --reps; its blocks / contiguous is what the kernel's page pinning per
iovec leaves to any library on that machine. With --steps, where each request length's time goes,
step by step (_kv_steps.py). With --busy-decode the decode's caller runs Python all the time, as a
serving engine's step does in the process that holds the connector, and polls for the request
between slices of 0.1 ms of it (poll(0), as vLLM's get_finished each step): what the transfer
part needs the interpreter lock for off that thread shows as time (a thread that gave the lock
up may wait for it up to the interpreter's switch interval, 5 ms by default). With --busy-prefill
the prefill's caller does the same while the request is out (its next engine step's Python, its
poll() between slices as vLLM's get_finished): what the prefill's side needs the lock for shows as
time. Each run also says how long after the prefill saw a request done its poll() reported the
blocks released (the decode's ack taken and the hold let go).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from . import _kv_steps, kv_peers
from ._plot import save_plot
from ._ranks import save_json

SECRET = "bench-kv"


def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flagcx_mesh.bench kv")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the KV caches live (default cpu)")
    p.add_argument("--tokens", default="2048,8192", help="request lengths in tokens, comma-separated (default 2048,8192)")
    p.add_argument("--paths", default="", help="paths to force, comma-separated (default: cma,tcp on cpu; cuda-ipc,cuda-vmm,staged on cuda)")
    p.add_argument("--layers", type=int, default=32, help="model layers, one KV cache each (default 32)")
    p.add_argument("--heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-size", type=int, default=128, help="head size (default 128)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--reps", type=int, default=5, help="requests timed per figure; each figure is their median (default 5)")
    p.add_argument("--peers", default="nixl,mooncake", help="other tools moving the same blocks in the same run "
                   "(bench agent's harness), comma-separated, or none (default nixl,mooncake)")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    p.add_argument("--plot", metavar="PNG", help="a plot of GB/s over request size per path: the KV request, the "
                   "contiguous write and the local gathers (needs matplotlib)")
    p.add_argument("--pull", choices=("on", "off"), default="on", help="whether the decode may read a request's "
                   "blocks itself (from the second request on a connection, on this host's paths: the connector's "
                   "default), else the prefill pushes each (default on)")
    p.add_argument("--steps", action="store_true", help="also print where a request's time goes, step by step "
                   "(both processes stamp the transfer part's steps: _kv_steps.py)")
    p.add_argument("--busy-decode", action="store_true", help="the decode's caller runs Python all the time, "
                   "polling between slices of 0.1 ms of it (as an engine's steps do beside the connector)")
    p.add_argument("--busy-prefill", action="store_true", help="the prefill's caller runs Python all the time "
                   "while a request is out, looking for its end between slices of 0.1 ms of it")
    p.add_argument("--role", default="prefill", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.tokens = [int(t) for t in a.tokens.split(",") if t]
    a.pull = a.pull == "on"
    a.peer_list = [] if a.peers.strip() == "none" else [x for x in a.peers.split(",") if x]
    a.paths = [x for x in a.paths.split(",") if x] or (["cma", "tcp"] if a.device == "cpu"
                                                       else ["cuda-ipc", "cuda-vmm", "staged"])
    return a


def _blocks(args) -> int:
    return max(args.tokens) // args.block_size


def _caches(torch, args) -> Dict[str, object]:
    n = _blocks(args)
    return {f"model.layers.{i}.self_attn.attn":
            torch.zeros(n, args.heads, args.block_size, 2 * args.head_size, dtype=torch.bfloat16, device=args.device)
            for i in range(args.layers)}


def _layer_bytes(args) -> int:
    return _blocks(args) * args.heads * args.block_size * 2 * args.head_size * 2


def _publish(d: str, name: str, data: bytes) -> None:
    with open(os.path.join(d, name + ".tmp"), "wb") as f:
        f.write(data)
    os.replace(os.path.join(d, name + ".tmp"), os.path.join(d, name))


def _read(d: str, name: str, timeout: float = 120.0, busy: bool = False, step=None) -> bytes:
    """The bytes another process published as ``name``, once there; ``busy``: waits running
    Python (the interpreter lock held) between looks, not sleeping, and calls ``step`` (an engine
    step's poll) after each slice."""
    path, end = os.path.join(d, name), time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit(f"bench kv: {path} never appeared (the other process failed?)")
        if busy:
            _busy(1e-4)
            if step is not None:
                step()
        else:
            time.sleep(0.005)
    with open(path, "rb") as f:
        return f.read()


def _plain_pair_region(torch, args, agent):
    """A contiguous buffer as large as every layer's cache, registered with a plain agent."""
    buf = torch.ones(_layer_bytes(args) * args.layers, dtype=torch.uint8, device=args.device)
    return buf, agent.register(buf)


def decode(args) -> int:
    """The child: fetches each request the prefill announces; times each fetch."""
    import torch

    from ..agent import Agent
    from ..vllm.transfer import KVTransfer

    if args.steps:
        _kv_steps.install()
    x = KVTransfer("bench-kv-decode", _caches(torch, args), _blocks(args), secret=SECRET)
    plain = Agent("bench-kv-plain-decode", SECRET)
    buf, region = _plain_pair_region(torch, args, plain)
    _publish(args.dir, "decode.json", json.dumps({"plain": plain.metadata().hex(), "region": region.descriptor.hex(),
                                                  "pid": os.getpid(), "addr": buf.data_ptr()}).encode())
    md = _read(args.dir, "prefill.meta")
    times: Dict[str, float] = {}
    rng = random.Random(1)
    for i in range(10 ** 6):
        ask = json.loads(_read(args.dir, f"ask-{i}"))
        if ask.get("stop"):
            break
        local = rng.sample(range(_blocks(args)), len(ask["blocks"]))
        t0 = time.perf_counter()
        x.fetch(ask["req"], md, ask["req"], ask["blocks"], local, hold_until=ask.get("hold_until", 0.0))
        while True:  # woken by the completion (poll's timeout), as a connector's blocking wait would be
            if args.busy_decode:
                _busy(1e-4)
                done = x.poll()
            else:
                done = x.poll(timeout=1.0)
            if done.failed:
                raise SystemExit(f"bench kv: request {ask['req']} failed: {done.failed}")
            if ask["req"] in done.recving:
                break
        times[ask["req"]] = time.perf_counter() - t0
        _publish(args.dir, f"took-{i}", json.dumps(times[ask["req"]]).encode())
    if args.steps:
        _publish(args.dir, "steps.json", _kv_steps.taken().encode())
    x.close()
    plain.close()
    return 0


def _busy(seconds: float) -> None:
    """Python for ``seconds`` (--busy-decode, --busy-prefill: an engine step's own work, the
    interpreter lock held)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(50))


class _Released:
    """The prefill's requests poll() reported released, as a connector's get_finished collects
    them each engine step."""

    def __init__(self, x):
        self.x, self.reqs, self.calls = x, set(), []

    def step(self, timeout: float = 0.0) -> None:
        t0 = time.perf_counter()
        self.reqs |= self.x.poll(timeout).sending
        if timeout == 0:
            self.calls.append(time.perf_counter() - t0)  # (what an engine step pays for it)

    def cost(self) -> dict:
        """The poll(0) calls' seconds: count, median, 99th percentile, most."""
        c = sorted(self.calls) or [0.0]
        return {"polls": len(self.calls), "poll_median_us": statistics.median(c) * 1e6,
                "poll_p99_us": c[min(len(c) - 1, int(len(c) * 0.99))] * 1e6, "poll_max_us": c[-1] * 1e6}


def _request(args, d: str, x, i: int, tokens: int, rng, released: _Released) -> tuple:
    """One request: (the decode's seconds, seconds from the prefill seeing it done until its
    poll() reported the blocks released). With --busy-prefill the prefill's caller polls between
    its slices of Python, as an engine step does."""
    blocks = rng.sample(range(_blocks(args)), tokens // args.block_size)
    req = f"req-{i}"
    x.hold(req, blocks)
    hold_until = time.time() + x.hold_timeout if args.pull else 0.0  # as a connector's kv_transfer_params say
    _publish(d, f"ask-{i}", json.dumps({"req": req, "blocks": blocks, "hold_until": hold_until}).encode())
    took = json.loads(_read(d, f"took-{i}", busy=args.busy_prefill, step=released.step))
    t0, end = time.perf_counter(), time.monotonic() + 60
    while req not in released.reqs:
        if time.monotonic() > end:
            raise SystemExit(f"bench kv: the prefill never released {req}")
        if args.busy_prefill:
            _busy(1e-4)
            released.step()
        else:
            released.step(0.05)
    return took, time.perf_counter() - t0


def _contiguous(args, conn, local, remote, tokens: int) -> float:
    """The same bytes as one write per layer (a layer's share each, each to bytes of its own, as
    the request's blocks are), issued at once, then waited."""
    per_layer = tokens // args.block_size * args.heads * args.block_size * 2 * args.head_size * 2
    t0 = time.perf_counter()
    handles = [conn.write(local, remote, per_layer, i * per_layer, i * per_layer) for i in range(args.layers)]
    for h in handles:
        h.wait(120)
    return time.perf_counter() - t0


def _batch_ops(args, local, remote, tokens: int, rng) -> List[list]:
    """The request's blocks as one op list per layer between the plain agents' buffers (each
    layer's share of its own, blocks shuffled on both sides, as the connector's are)."""
    block = args.heads * args.block_size * 2 * args.head_size * 2
    n = tokens // args.block_size
    layers = []
    for i in range(args.layers):
        base = i * n * block
        src, dst = rng.sample(range(n), n), rng.sample(range(n), n)
        layers.append([(local, base + s * block, remote, base + d * block, block) for s, d in zip(src, dst)])
    return layers


def _batch(conn, layers) -> float:
    """The same blocks as one batch_write per layer (op lists built beforehand), issued at once, then waited."""
    t0 = time.perf_counter()
    handles = [conn.batch_write(ops) for ops in layers]
    for h in handles:
        h.wait(120)
    return time.perf_counter() - t0


def _raw_cma_calls(args, local_addr: int, remote_addr: int, layers, tokens: int) -> tuple:
    """The kernel-alone reference's iovecs (_rawcma.py), made once as the batch's op lists are:
    the request's blocks (``layers``, as _batch_ops made them) and the same bytes as one iovec
    per layer, between the plain agents' buffers of the same two processes."""
    from . import _rawcma  # (libc's process_vm_writev, looked up only where cma runs)

    per_layer = tokens // args.block_size * args.heads * args.block_size * 2 * args.head_size * 2
    scattered = _rawcma.prepare([(local_addr + op[1], remote_addr + op[3], op[4]) for ops in layers for op in ops])
    contiguous = _rawcma.prepare([(local_addr + i * per_layer, remote_addr + i * per_layer, per_layer)
                                  for i in range(args.layers)])
    return scattered, contiguous


def _raw_cma_seconds(pid: int, calls) -> list:
    """Seconds the kernel alone took to write each of _raw_cma_calls' iovec lists into ``pid``."""
    from . import _rawcma

    return [_rawcma.write_seconds(pid, c) for c in calls]


def _sync(torch, args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def _gather_ms(torch, args, tokens: int, dtype, rng) -> float:
    """Median ms of one process copying a request's blocks between two caches of the same shape
    (every layer: shuffled source blocks onto shuffled destination blocks), viewed as `dtype`."""
    n, k = _blocks(args), tokens // args.block_size
    row = args.heads * args.block_size * 2 * args.head_size * 2 // torch.tensor([], dtype=dtype).element_size()
    src = [torch.ones(n, row, dtype=dtype, device=args.device) for _ in range(args.layers)]
    dst = [torch.zeros(n, row, dtype=dtype, device=args.device) for _ in range(args.layers)]
    times = []
    for _ in range(args.reps):
        si = torch.tensor(rng.sample(range(n), k), device=args.device)
        di = torch.tensor(rng.sample(range(n), k), device=args.device)
        _sync(torch, args)
        t0 = time.perf_counter()
        for s, d in zip(src, dst):
            d.index_copy_(0, di, s.index_select(0, si))
        _sync(torch, args)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _register_time(torch, args, agent, reps: int = 5) -> float:
    """Median ms of registering (then deregistering) a 256 MiB buffer on --device."""
    buf = torch.zeros(256 << 20, dtype=torch.uint8, device=args.device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = agent.register(buf)
        times.append((time.perf_counter() - t0) * 1e3)
        agent.deregister(r)
    return statistics.median(times)


def _measure_path(args, path: str) -> Dict[str, object]:
    import torch

    from ..agent import Agent
    from ..vllm.transfer import KVTransfer

    var = "FLAGCX_MESH_TRANSPORT" if args.device == "cpu" else "FLAGCX_MESH_CUDA_PATH"
    os.environ[var] = path
    d = tempfile.mkdtemp(prefix="bench-kv-")
    child = subprocess.Popen([sys.executable, "-m", "flagcx_mesh.bench", "kv", "--role", "decode", "--dir", d,
                              "--device", args.device, f"--tokens={max(args.tokens)}", f"--layers={args.layers}",
                              f"--heads={args.heads}", f"--head-size={args.head_size}",
                              f"--block-size={args.block_size}"] + (["--steps"] if args.steps else []) +
                             (["--busy-decode"] if args.busy_decode else []))
    if args.steps:
        _kv_steps.install()
        _kv_steps.clear()
    x = plain = None
    try:
        x = KVTransfer("bench-kv-prefill", _caches(torch, args), _blocks(args), secret=SECRET)
        plain = Agent("bench-kv-plain-prefill", SECRET)
        _publish(d, "prefill.meta", x.metadata)
        peer = json.loads(_read(d, "decode.json"))
        buf, local = _plain_pair_region(torch, args, plain)
        t0 = time.perf_counter()
        conn = plain.connect(bytes.fromhex(peer["plain"]))
        connect_ms = (time.perf_counter() - t0) * 1e3
        remote = bytes.fromhex(peer["region"])
        row: Dict[str, object] = {"path": conn.path_to(remote), "connect_ms": connect_ms,
                                  "register_256MiB_ms": _register_time(torch, args, plain), "tokens": {}}
        rng, i = random.Random(0), 0
        released = _Released(x)
        for tokens in args.tokens:
            kv, ref, bat, raw, rel = [], [], [], [], []
            pushes_before = x.stats()["pushes"]
            layers = _batch_ops(args, local, remote, tokens, rng)
            raw_calls = _raw_cma_calls(args, buf.data_ptr(), peer["addr"], layers, tokens) \
                if row["path"] == "cma" else ()
            for _ in range(args.reps):
                took, lag = _request(args, d, x, i, tokens, rng, released)
                kv.append(took)
                rel.append(lag)
                i += 1
                ref.append(_contiguous(args, conn, local, remote, tokens))
                bat.append(_batch(conn, layers))
                if raw_calls:
                    raw.append(_raw_cma_seconds(peer["pid"], raw_calls))
            nbytes = tokens * args.layers * args.heads * 2 * args.head_size * 2
            k, r, b = statistics.median(kv), statistics.median(ref), statistics.median(bat)
            row["tokens"][str(tokens)] = {"bytes": nbytes, "kv_ms": k * 1e3, "kv_gbs": nbytes / k / 1e9,
                                          "contiguous_ms": r * 1e3, "contiguous_gbs": nbytes / r / 1e9,
                                          "batch_ms": b * 1e3, "batch_gbs": nbytes / b / 1e9,
                                          "gather_uint8_ms": _gather_ms(torch, args, tokens, torch.uint8, rng),
                                          "gather_int64_ms": _gather_ms(torch, args, tokens, torch.int64, rng),
                                          "requests": args.reps, "pushed": x.stats()["pushes"] - pushes_before,
                                          "release_ms": statistics.median(rel) * 1e3, "release_max_ms": max(rel) * 1e3}
            if raw:
                row["tokens"][str(tokens)].update(kernel_scattered_ms=statistics.median(r[0] for r in raw) * 1e3,
                                                  kernel_contiguous_ms=statistics.median(r[1] for r in raw) * 1e3)
        _publish(d, f"ask-{i}", json.dumps({"stop": True}).encode())
        if child.wait(timeout=120) != 0:
            raise SystemExit(f"bench kv: the decode process failed (exit {child.returncode})")
        if released.calls:
            row["prefill_poll"] = released.cost()
        if args.steps:
            print(f"  {path}:", flush=True)
            made = [t for t in args.tokens for _ in range(args.reps)]
            row["steps_ms"] = _kv_steps.report(_read(d, "steps.json").decode(), made)
        return row
    finally:
        if child.poll() is None:
            child.kill()
        try:
            child.wait(timeout=30)
        finally:
            for end in (x, plain):
                if end is not None:
                    end.close()
            shutil.rmtree(d, ignore_errors=True)  # the two processes' exchange files


def _report(data: dict, args) -> None:
    print(f"one request's KV, prefill -> decode ({args.layers} layers, {args.heads} KV heads, head size "
          f"{args.head_size}, bf16, blocks of {args.block_size} tokens; {args.device}; median of {args.reps})")
    print(f"  {'path':>9}{'taken':>10}{'tokens':>8}{'MiB':>8}{'KV ms':>9}{'KV GB/s':>9}"
          f"{'contig ms':>11}{'contig GB/s':>13}{'KV/contig':>11}{'batch ms':>10}{'batch/contig':>14}"
          f"{'gather u8/i64 ms':>18}{'gather u8/KV':>14}")
    for path, row in data["paths"].items():
        print(f"  {path}: register 256 MiB {row['register_256MiB_ms']:.3f} ms (median of 5), "
              f"connect {row['connect_ms']:.2f} ms")
    for path, row in data["paths"].items():
        for tokens, f in row["tokens"].items():
            print(f"  {path:>9}{row['path']:>10}{tokens:>8}{f['bytes'] / 2**20:>8.0f}{f['kv_ms']:>9.2f}"
                  f"{f['kv_gbs']:>9.2f}{f['contiguous_ms']:>11.2f}{f['contiguous_gbs']:>13.2f}"
                  f"{f['kv_gbs'] / f['contiguous_gbs']:>11.2f}{f['batch_ms']:>10.2f}"
                  f"{f['batch_gbs'] / f['contiguous_gbs']:>14.2f}"
                  f"{f['gather_uint8_ms']:>10.3f}/{f['gather_int64_ms']:<7.3f}{f['gather_uint8_ms'] / f['kv_ms']:>14.2f}")
    for path, row in data["paths"].items():
        lags = [f"{tokens} tokens {f['release_ms']:.2f} (max {f['release_max_ms']:.2f})" for tokens, f in row["tokens"].items()
                if "release_ms" in f]
        if lags:
            print(f"  {path}: the prefill's poll() reported the blocks released, ms after it saw the request done "
                  f"(median): {', '.join(lags)}")
        if "prefill_poll" in row:
            c = row["prefill_poll"]
            print(f"  {path}: the prefill's poll(0) between its slices, us: median {c['poll_median_us']:.1f}, "
                  f"p99 {c['poll_p99_us']:.1f}, max {c['poll_max_us']:.1f} ({c['polls']} calls)")
    for path, row in data["paths"].items():
        how = [f"{tokens} tokens {f['pushed']} of {f['requests']}" for tokens, f in row["tokens"].items() if "pushed" in f]
        if how:
            print(f"  {path}: requests the prefill pushed (the others the decode read itself): {', '.join(how)}")
    for path, row in data["paths"].items():
        for tokens, f in row["tokens"].items():
            if "kernel_scattered_ms" in f:
                s, c = f["kernel_scattered_ms"], f["kernel_contiguous_ms"]
                print(f"  {path}, {tokens} tokens, the kernel alone (process_vm_writev, no library): the blocks "
                      f"{s:.2f} ms, one iovec a layer {c:.2f} ms: blocks / contiguous {c / s:.2f} (the library's "
                      f"batch/contig {f['batch_gbs'] / f['contiguous_gbs']:.2f})")


def plot(data: dict, args) -> bool:
    """--plot: per path, the request's GB/s beside the contiguous write's, the batch's and the local gathers'."""
    panels = []
    for path, row in data["paths"].items():
        series: Dict[str, Dict[str, float]] = {"KV request": {}, "contiguous write": {}, "batch_write per layer": {},
                                               "local gather (uint8)": {}, "local gather (int64)": {}}
        for f in row["tokens"].values():
            at = str(f["bytes"])
            series["KV request"][at] = f["kv_gbs"]
            series["contiguous write"][at] = f["contiguous_gbs"]
            series["batch_write per layer"][at] = f["batch_gbs"]
            series["local gather (uint8)"][at] = f["bytes"] / f["gather_uint8_ms"] / 1e6
            series["local gather (int64)"][at] = f["bytes"] / f["gather_int64_ms"] / 1e6
        panels.append((f"{path} (taken: {row['path']})", series))
    return save_plot(args.plot, f"one request's KV, prefill -> decode ({args.device}, blocks of {args.block_size} "
                                f"tokens, {args.heads} KV heads)", panels)


_EXPANDABLE = "expandable_segments:True"


def _alloc_conf() -> str:
    """torch's allocator settings: PYTORCH_ALLOC_CONF where set (newer torch reads it first), else
    PYTORCH_CUDA_ALLOC_CONF."""
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


def _needs_own_process(args, path: str) -> bool:
    """cuda-vmm needs torch's expandable segments (cuMem memory), which the allocator reads once,
    at CUDA's start: without them in this process the path would fall back (to staged)."""
    return args.device == "cuda" and path == "cuda-vmm" and _EXPANDABLE not in _alloc_conf()


def _measure_apart(argv: List[str], path: str, timeout: float = 1800.0) -> Dict[str, object]:
    """_measure_path(path) in a process of its own, with torch's expandable segments on (in both
    of torch's variables: whichever it reads)."""
    with tempfile.TemporaryDirectory(prefix="bench-kv-vmm-") as d:
        out = os.path.join(d, "row.json")
        conf = ",".join(x for x in (_alloc_conf(), _EXPANDABLE) if x)
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf, PYTORCH_ALLOC_CONF=conf)
        cmd = [sys.executable, "-m", "flagcx_mesh.bench", "kv", *argv, f"--paths={path}", "--role=path",
               f"--dir={out}"]
        try:
            done = subprocess.run(cmd, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"bench kv: measuring {path} in a process of its own took more than {timeout:.0f} s") \
                from None
        if done.returncode != 0:
            raise SystemExit(f"bench kv: measuring {path} in a process of its own failed (exit {done.returncode})")
        with open(out) as f:
            return json.load(f)


def main(argv: List[str]) -> int:
    args = _parse(argv)
    if args.role == "decode":
        return decode(args)
    if args.role == "path":  # _measure_apart's child: one path's row into --dir (a file)
        save_json(_measure_path(args, args.paths[0]), args.dir)
        return 0
    data = {"device": args.device, "paths": {p: _measure_apart(argv, p) if _needs_own_process(args, p)
                                             else _measure_path(args, p) for p in args.paths}}
    if args.peer_list:
        data["peers"] = {str(t): kv_peers.measure(args, t) for t in args.tokens}
    _report(data, args)
    kv_peers.report(data, args)
    save_json(data, args.json)
    plot(data, args)
    return 0
