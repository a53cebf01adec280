"""The vLLM connector's transfer part between two processes, without vLLM: a prefill holds
requests' blocks of KV caches in vLLM's layout, a decode fetches them into blocks of its own
and checks every byte.

    python tests/vllm_transfer_prog.py [--device cpu|cuda] [--layout vllm|legacy|cross]
        [--layers 4] [--blocks 64] [--requests 6] [--heads 2] [--head-size 16] [--block-size 16]

run alone, it starts the prefill here and the decode as a child process (the agent's secret is
made up when FLAGCX_MESH_AGENT_SECRET is unset). The roles, for the tests (tests/test_vllm_transfer.py):

    --role prefill --dir D    registers and fills its caches, holds the requests, publishes
                              D/prefill.meta and D/requests.json, prints "released N" once
                              N requests were released (--expect, default all), then exits
    --role decode --dir D     fetches every request (all blocks, or its tail for every other
                              one), prints "checked B blocks of R requests" or "FAILED ..."
    --die-on-push             prefill: exits (status 9) right after issuing a push's first layer
    --die-after-want          decode: exits (status 9) right after asking, without waiting
    --hold-timeout S          prefill: seconds a request is held for a decode (default 60)
    --pull N                  decode: the first request fetched alone (pushed), the others with a
                              hold_until; fails unless N of them were read by the decode itself
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from meshutil import publish, read_published  # noqa: E402
from vllm_kv import block_matches, fill_block, make_kv_caches  # noqa: E402

from flagcx_mesh.errors import MeshError  # noqa: E402
from flagcx_mesh.vllm import transfer  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="both")
    p.add_argument("--dir")
    p.add_argument("--name", default="")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layout", default="vllm")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--blocks-per-request", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--expect", type=int, default=-1)
    p.add_argument("--hold-timeout", type=float, default=60.0)
    p.add_argument("--fetch-timeout", type=float, default=60.0)
    p.add_argument("--die-on-push", action="store_true")
    p.add_argument("--die-after-want", action="store_true")
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--expect-path", default="", help="prefill: fail unless every push took this path")
    p.add_argument("--pull", type=int, default=-1, help="decode: fetch the first request alone, then the rest with "
                   "a hold_until, and fail unless exactly this many of them were read by the decode itself "
                   "(-1: every fetch at once, no hold_until: all pushed)")
    return p.parse_args(argv)


def caches(args):
    return make_kv_caches(range(args.layers), args.blocks, args.heads, args.block_size, args.head_size,
                          device=args.device, layout=args.layout)


def request_blocks(args):
    """Request i holds blocks of its own: --blocks-per-request + i % 4 of them, from the top
    of the cache down."""
    out, nxt = {}, args.blocks - 1
    for i in range(args.requests):
        n = args.blocks_per_request + i % 4
        if nxt + 1 < n:
            raise SystemExit(f"{args.blocks} blocks are too few for {args.requests} requests")
        out[f"req-{i}"] = [nxt - k for k in range(n)]
        nxt -= n
    return out


def prefill(args) -> int:
    kv, bdim = caches(args)
    reqs = request_blocks(args)
    for li, t in enumerate(kv.values()):
        for b in sorted({b for blocks in reqs.values() for b in blocks}):
            fill_block(t, b, bdim, f"{li}/{b}")
    if args.device == "cuda":
        torch.cuda.synchronize()
    x = transfer.KVTransfer(args.name or "prefill-tp0", kv, args.blocks, block_dim=bdim,
                            hold_timeout=args.hold_timeout)
    if args.die_on_push:
        def start_then_die(req, peer, f, incarnation=None, raw=None):
            layout = x._peer_layouts[(peer, incarnation or f.get("_inc", ""))]
            table = x._push_table(x._held[req].blocks, [int(b) for b in f["dst"]], layout)
            x.agent.connection(peer).write_blocks(x._regions, layout[0], table[:len(table) // 2])  # part of it
            os._exit(9)

        x._start_push = start_then_die
    for r, blocks in reqs.items():
        x.hold(r, blocks)
    publish(args.dir, "requests.json", json.dumps(reqs).encode())
    publish(args.dir, "prefill.meta", x.metadata)
    expect = len(reqs) if args.expect < 0 else args.expect
    released, end = set(), time.monotonic() + args.timeout
    paths = set()
    while len(released) < expect and time.monotonic() < end:
        released |= x.poll().sending
        paths = paths or pushed_paths(x)  # while the decode is connected
        time.sleep(0.01)
    print(f"released {len(released)}", flush=True)
    print(f"paths {' '.join(sorted(paths))}", flush=True)
    x.close()
    if args.expect_path and paths != {args.expect_path}:
        print(f"FAILED: the pushes took {sorted(paths)}, expected {args.expect_path}", flush=True)
        return 5
    return 0 if len(released) >= expect else 1


def pushed_paths(x) -> set:
    """The paths the prefill's pushes took: each local region to each of the decodes' regions (none
    for a decode that left meanwhile: its regions are deregistered, its connection going)."""
    out = set()
    for (peer, _inc), (regions, _layers) in list(x._peer_layouts.items()):
        conn = x.agent.connection(peer)
        try:
            if conn is not None:
                out |= {conn.path_to(r, local) for r in regions for local in x._regions}
        except MeshError:  # it left (a decode refused for its layout exits at once): nothing pushed to it
            pass
    return out


def decode(args) -> int:
    kv, bdim = caches(args)
    x = transfer.KVTransfer(args.name or "decode-tp0", kv, args.blocks, block_dim=bdim,
                            fetch_timeout=args.fetch_timeout)
    if args.die_after_want:
        x._on_answer = x._await_done = lambda *a: None  # it dies before it takes any answer (nor the core for it)
    md = read_published(args.dir, "prefill.meta", args.timeout)
    reqs = json.loads(read_published(args.dir, "requests.json", args.timeout))
    plan, nxt = {}, 0
    got, failed, t0 = set(), {}, time.monotonic()
    end = t0 + args.timeout

    def wait_for(n):
        while len(got) < n and time.monotonic() < end:
            done = x.poll(timeout=0.01)
            got.update(done.recving)
            failed.update(done.failed)

    for i, (r, remote) in enumerate(sorted(reqs.items())):
        take = len(remote) if i % 2 == 0 else max(1, len(remote) - 1)  # odd ones: a local prefix hit
        local = list(range(nxt, nxt + take))
        nxt += take
        plan[r] = (remote[len(remote) - take:], local)
        x.fetch(r, md, r, remote, local, hold_until=time.time() + 600 if args.pull >= 0 and i > 0 else 0.0)
        if args.pull >= 0 and i == 0:
            wait_for(1)  # pushed: the prefill's layout came meanwhile, so the decode may read the others
            while time.monotonic() < end and not (x._plans or False in x._pull_path.values()):
                time.sleep(0.005)  # once its thread took it (the core reports the push without that thread)
    if args.die_after_want:
        time.sleep(0.2)
        os._exit(9)
    wait_for(len(plan))
    elapsed = time.monotonic() - t0
    if failed or len(got) < len(plan):
        print(f"FAILED: received {sorted(got - set(failed))}, failed {sorted(failed)} "
              f"(blocks {sorted(b for v in failed.values() for b in v)}), missing {sorted(set(plan) - got)}",
              flush=True)
        x.close()
        return 3
    bad, nblocks = [], 0
    for li, t in enumerate(kv.values()):
        for r, (src, local) in plan.items():
            for s, d in zip(src, local):
                nblocks += 1
                if not block_matches(t, d, bdim, f"{li}/{s}"):
                    bad.append((li, r, s, d))
    moved = sum(len(v[1]) for v in plan.values()) * sum(
        t.select(bdim, 0).numel() * t.element_size() for t in kv.values())
    pulled = x.stats()["pulls"]
    x.close()
    if bad:
        print(f"FAILED: {len(bad)} blocks differ, first {bad[:4]}", flush=True)
        return 4
    if args.pull >= 0 and pulled != args.pull:
        print(f"FAILED: {pulled} requests were read by the decode, expected {args.pull}", flush=True)
        return 6
    print(f"pulled {pulled} of {len(plan)} requests", flush=True)
    print(f"checked {nblocks} blocks of {len(plan)} requests ({moved} bytes in {elapsed * 1e3:.1f} ms)", flush=True)
    return 0


def both(args) -> int:
    os.environ.setdefault("FLAGCX_MESH_AGENT_SECRET", os.urandom(16).hex())
    d = args.dir or tempfile.mkdtemp(prefix="vllm-transfer-")
    common = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k in ("device", "layout", "layers", "blocks", "requests", "blocks_per_request", "heads", "head_size",
                       "block_size", "pull")]
    child = subprocess.Popen([sys.executable, __file__, "--role", "decode", "--dir", d, *common])
    args.dir = d
    rc = prefill(args)
    crc = child.wait(timeout=args.timeout + 30)
    print("vllm_transfer_prog: OK" if rc == 0 and crc == 0 else f"vllm_transfer_prog: FAILED ({rc}, {crc})")
    return 0 if rc == 0 and crc == 0 else 1


if __name__ == "__main__":
    a = parse()
    sys.exit({"prefill": prefill, "decode": decode, "both": both}[a.role](a))
