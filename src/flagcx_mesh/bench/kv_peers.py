"""`bench kv --peers`: NIXL and Mooncake TE moving the same request's blocks, in the same run.

The peers are driven by `bench agent`'s harness (agents/_peers.py on host memory,
agents/_gpu_peers.py on GPU memory: NIXL through prepared descriptor lists posted as one
transfer, as vLLM's NixlConnector calls it; Mooncake TE through one batch_transfer_sync_write of
the request's entries), started here as `python -m flagcx_mesh.bench agent` with the request's
shape: one batch of `blocks x layers` blocks of one layer's block bytes (scattered: remote offsets
reversed), the agent's own batch of the same blocks beside them. Its JSON is read back; each
tool's pipelined GB/s becomes milliseconds per request, set beside the connector's KV request.
A peer that is not installed is reported NOT RUN with its reason, as `bench agent` says it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List

from ._sizes import size_name

TIMEOUT_S = 1200


def _command(args, block: int, count: int, peers: List[str], out: str) -> List[str]:
    region = block * count
    cmd = [sys.executable, "-m", "flagcx_mesh.bench", "agent", "--device", args.device, "--region", str(region),
           "--blocks", str(block), "--count", str(count), "--peers", ",".join(peers), "--setups", "1",
           "--connects", "1", "--mesh-put", "off", "--json", out]
    if args.device == "cuda":
        return cmd + ["--paths", args.paths[0], "--bytes", str(max(4 * region, 1 << 30))]
    return cmd + ["--transports", args.paths[0], "--churn", "0"]


def _pipelined(fig: Dict, block: int, device: str):
    """A tool's pipelined GB/s for `block` from bench agent's JSON (None when it did not run)."""
    if "error" in fig:
        return None
    if device == "cuda":
        return fig.get("request", {}).get(size_name(block), {}).get("pipelined_GBps")
    return fig.get(f"request_{size_name(block)}", {}).get("pipelined_GBps")


def measure(args, tokens: int) -> Dict[str, Dict]:
    """{tool: {"ms": ..., "GBps": ...} or {"error": why}} for one request of `tokens` tokens."""
    block = args.heads * args.block_size * 2 * args.head_size * 2
    count = tokens // args.block_size * args.layers
    fd, out = tempfile.mkstemp(prefix="bench-kv-peers-", suffix=".json")
    os.close(fd)
    try:
        p = subprocess.run(_command(args, block, count, args.peer_list, out), capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        with open(out) as f:
            data = json.load(f) if os.path.getsize(out) else {}
    except (subprocess.TimeoutExpired, OSError, ValueError) as e:
        return {name: {"error": f"bench agent did not finish: {e}"} for name in args.peer_list}
    finally:
        os.unlink(out)
    for line in p.stdout.splitlines():  # the harness's own lines: each tool's figures, NOT RUN reasons
        if line.startswith("["):
            print(f"  bench agent {line}", flush=True)
    if not data:
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        return {name: {"error": f"bench agent exited {p.returncode}: {' | '.join(tail)}"} for name in args.peer_list}
    tools = {"flagcx_mesh agent": next(iter(data.get("flagcx_mesh", {}).values()), {"error": "not run"}),
             **{name: data.get("peers", {}).get(name, {"error": "not run"}) for name in args.peer_list}}
    nbytes = block * count
    result: Dict[str, Dict] = {}
    for name, fig in tools.items():
        gbs = _pipelined(fig, block, args.device)
        result[name] = ({"error": fig.get("error", "no figure")} if not gbs
                        else {"GBps": gbs, "ms": nbytes / gbs / 1e6, "version": fig.get("version", "")})
    return result


def report(data: Dict, args) -> None:
    """One line per tool and request size: its ms, and how much longer it takes than the
    flagcx_mesh agent's batch of the same blocks and than the connector's KV request (the
    request adds its round trip between the two transfer threads: ask, push, notification)."""
    for tokens, tools in data.get("peers", {}).items():
        kv = [row["tokens"][tokens]["kv_ms"] for row in data["paths"].values() if tokens in row["tokens"]]
        ours = tools.get("flagcx_mesh agent", {}).get("ms")
        for name, f in tools.items():
            if "error" in f:
                print(f"  peers, {tokens} tokens: {name} NOT RUN: {f['error']}")
                continue
            ratios = [f"{f['ms'] / ref:.2f}x the {what}" for ref, what in
                      ((ours, "agent's batch"), (min(kv) if kv else None, "KV request"))
                      if ref and not (name == "flagcx_mesh agent" and what == "agent's batch")]
            print(f"  peers, {tokens} tokens: {name} {f['version']} moves the request's blocks in {f['ms']:.2f} ms "
                  f"({f['GBps']:.2f} GB/s, one batch): {', '.join(ratios)} (above 1: flagcx_mesh faster)")
