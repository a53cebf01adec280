"""The writer of tests/test_agent_dereg.py.

    put DIR SIZE [blocks]   connects to the agent whose metadata is DIR/owner.meta, writes SIZE
                   bytes of 0xAB to the region DIR/owner.region (the test stops this process while
                   the put lands) and waits for the write's handle; prints "handle ok" or "handle
                   failed: <error>". blocks: as one batch_write of 64 KiB blocks in order (over
                   tcp one frame, transport/tcp/block_batch.h), not one write
    dev-owner DIR SIZE   (the fake CUDA driver, copies to the device slowed) registers SIZE bytes
                   of device memory (zeros), writes DIR/owner.meta and DIR/owner.region, waits
                   until a put's first chunks are being copied up (staged: the landing ring),
                   deregisters with timeout 0.2 s ("raised: <error>" or "deregister returned"),
                   then once DIR/writer.done exists says whether any byte changed meanwhile
                   ("unchanged" or "changed N") and prints "dev-owner ok"
FLAGCX_MESH_TRANSPORT (tcp), FLAGCX_MESH_CUDA_PATH and FLAGCX_MESH_TCP_LANES come from the environment.
"""

import os
import sys

import time

import numpy as np

from flagcx_mesh import MeshTimeout
from flagcx_mesh.agent import Agent
from meshutil import publish, read_published

SECRET = "agent-test-secret"


def put(d: str, size: int, blocks: bool = False) -> None:
    with Agent("writer", SECRET, timeout=60) as a:
        conn = a.connect(read_published(d, "owner.meta"))
        remote = read_published(d, "owner.region")
        buf = np.full(size, 0xAB, dtype=np.uint8)
        local = a.register(buf)
        block = 64 << 10
        if blocks:
            h = conn.batch_write([(local, off, remote, off, block) for off in range(0, size, block)])
        else:
            h = conn.write(local, remote, size)
        try:
            h.wait(60)
            print("handle ok", flush=True)
        except Exception as e:  # noqa: BLE001 - the test reads the error's words
            print(f"handle failed: {type(e).__name__}: {e}", flush=True)


def dev_owner(d: str, size: int) -> None:
    import fakecuda
    from gpu_prog import FakeBuf

    cu = fakecuda.FakeCuda.get()
    with Agent("owner", SECRET, timeout=60) as a:
        buf = FakeBuf(cu, cu.alloc(size), size)
        buf.write(0, bytes(size))
        region = a.register(buf)
        publish(d, "owner.region", region.descriptor)
        publish(d, "owner.meta", a.metadata())
        queued = cu.calls("cuMemcpyAsync")
        end = time.monotonic() + 60
        while cu.calls("cuMemcpyAsync") < queued + 2:  # the put's first chunks go up (not read here:
            if time.monotonic() > end:  # a read beside a copy is a race to TSan)
                raise SystemExit("FAILED: no chunk of the put was copied up")
            time.sleep(0.001)
        try:
            a.deregister(region, timeout=0.2)
            print("deregister returned", flush=True)
        except MeshTimeout as e:
            print(f"raised: {e}", flush=True)
        before = buf.read(0, size)
        read_published(d, "writer.done", timeout=90)
        time.sleep(0.2)
        after = buf.read(0, size)
        changed = int(np.count_nonzero(np.frombuffer(after, np.uint8) != np.frombuffer(before, np.uint8)))
        print("unchanged" if changed == 0 else f"changed {changed}", flush=True)
    print("dev-owner ok", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "put":
        put(sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["blocks"])
    elif sys.argv[1] == "dev-owner":
        dev_owner(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(f"unknown role {sys.argv[1]}")
