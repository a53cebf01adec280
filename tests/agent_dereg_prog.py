"""The writer of tests/test_agent_dereg.py.

    put DIR SIZE   connects to the agent whose metadata is DIR/owner.meta, writes SIZE bytes of
                   0xAB to the region DIR/owner.region (the test stops this process while the
                   put lands) and waits for the write's handle; prints "handle ok" or
                   "handle failed: <error>"
FLAGCX_MESH_TRANSPORT (tcp) and FLAGCX_MESH_TCP_LANES come from the environment.
"""

import os
import sys

import numpy as np

from flagcx_mesh.agent import Agent
from meshutil import read_published

SECRET = "agent-test-secret"


def put(d: str, size: int) -> None:
    with Agent("writer", SECRET, timeout=60) as a:
        conn = a.connect(read_published(d, "owner.meta"))
        remote = read_published(d, "owner.region")
        buf = np.full(size, 0xAB, dtype=np.uint8)
        local = a.register(buf)
        h = conn.write(local, remote, size)
        try:
            h.wait(60)
            print("handle ok", flush=True)
        except Exception as e:  # noqa: BLE001 - the test reads the error's words
            print(f"handle failed: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "put":
        put(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(f"unknown role {sys.argv[1]}")
