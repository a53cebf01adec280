"""Prefill -> decode KV-cache transfer with agents: one prefill serves decodes that come and go.

The prefill process makes an Agent, registers its KV cache (layers x blocks x block bytes) once,
and publishes its metadata in a directory. Decode processes start in waves (--rounds, --decodes
per wave): each makes an Agent of its own, registers a receive buffer, connects to the prefill
and asks for its blocks with a notification carrying its region descriptor. The prefill answers
each request with one batched write of the blocks that decode asked for, followed by a
notification with their checksum; the decode checks the bytes it received against it and leaves.
Nothing is collective: the prefill never stops, registers nothing again, and never learns how
many decodes there will be.

    python examples/pd_kv_agent.py [--decodes 4] [--rounds 2] [--layers 8] [--blocks 16] [--block 64K]

Both sides prove FLAGCX_MESH_AGENT_SECRET (set here for the children when unset).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time

try:
    import numpy as np
except ModuleNotFoundError:  # one line naming the extra, not a traceback
    sys.exit(f"{__file__} needs numpy: pip install 'flagcx_mesh[bench]' (or pip install numpy)")

from flagcx_mesh import Agent


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--block", type=int, default=64 << 10)
    p.add_argument("--role", default="prefill")
    p.add_argument("--dir")
    p.add_argument("--id", type=int, default=0)
    return p.parse_args()


def wanted(i: int, args) -> list:
    """The (layer, block) pairs decode i asks for: every layer, a few blocks of its own."""
    return [(layer, (i + k) % args.blocks) for layer in range(args.layers) for k in range(3)]


def decode(args) -> int:
    with Agent(f"decode-{args.id}") as a:
        pairs = wanted(args.id, args)
        buf = np.zeros(len(pairs) * args.block, np.uint8)
        mine = a.register(buf)
        with open(os.path.join(args.dir, "prefill.meta"), "rb") as f:
            conn = a.connect(f.read())
        conn.notify(b"req " + mine.descriptor)
        for n in a.notifications(timeout=30):
            digest = n.data.split(b" ", 1)[1].decode()
            ok = hashlib.blake2b(buf.tobytes(), digest_size=16).hexdigest() == digest
            print(f"decode-{args.id}: {len(pairs)} blocks {'ok' if ok else 'MISMATCH'}", flush=True)
            return 0 if ok else 1
        print(f"decode-{args.id}: no answer", flush=True)
        return 1


def prefill(args) -> int:
    os.environ.setdefault("FLAGCX_MESH_AGENT_SECRET", os.urandom(16).hex())
    d = tempfile.mkdtemp(prefix="pd-agent-")
    kv = np.random.default_rng(1).integers(0, 256, args.layers * args.blocks * args.block, dtype=np.uint8)
    with Agent("prefill") as p:
        cache = p.register(kv)
        with open(os.path.join(d, "prefill.meta"), "wb") as f:
            f.write(p.metadata())
        failed = 0
        for r in range(args.rounds):
            ids = range(r * args.decodes, (r + 1) * args.decodes)
            kids = [subprocess.Popen([sys.executable, __file__, "--role", "decode", "--dir", d, "--id", str(i),
                                      "--layers", str(args.layers), "--blocks", str(args.blocks),
                                      "--block", str(args.block)]) for i in ids]
            served, end = 0, time.monotonic() + 60
            while served < len(kids) and time.monotonic() < end:
                for n in p.notifications(timeout=1):
                    i = int(n.peer.split("-")[1])
                    remote = n.data[4:]
                    pairs = wanted(i, args)
                    ops = [(cache, (layer * args.blocks + b) * args.block, remote, k * args.block, args.block)
                           for k, (layer, b) in enumerate(pairs)]
                    sent = b"".join(kv[o:o + args.block].tobytes() for _, o, _, _, _ in ops)
                    digest = hashlib.blake2b(sent, digest_size=16).hexdigest()
                    p.connection(n.peer).batch_write(ops, notification=b"done " + digest.encode()).wait(30)
                    served += 1
            failed += sum(k.wait(timeout=60) != 0 for k in kids) + (len(kids) - served)
            print(f"round {r}: served {served} decodes; peers now {len(p.peers())}", flush=True)
    print("pd_kv_agent: OK" if failed == 0 else f"pd_kv_agent: {failed} FAILED", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    a = parse()
    sys.exit(decode(a) if a.role == "decode" else prefill(a))
